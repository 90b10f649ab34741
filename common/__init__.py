"""What the cloud and edge sides share: configuration, the CLI entry point, the hook manager."""
