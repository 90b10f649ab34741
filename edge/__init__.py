"""The edge agent: trains locally on a Jetson, pushes per-layer gradients to the gateway."""
