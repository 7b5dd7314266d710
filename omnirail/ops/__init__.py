"""Operating a mesh: the local launcher, compose generation and health checks."""
