"""The commands a user runs besides the two roles: `elasticfed linksim` (a lossy, rate-capped link
between real processes, for trying a deployment on one machine) and `elasticfed keys` (CURVE key
pairs and the gateway's enrolled devices).  The library they stand on is in `common/`."""
