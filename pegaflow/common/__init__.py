"""Values and wire formats every side shares: keys, geometry, errors, deadlines,
socket frames, checksums, settings' checks, and the kernel's word on who is
calling. Imports nothing else of pegaflow: the client, the connector, the
kernels, the SSD tier and both daemons build on it."""
