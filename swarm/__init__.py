"""swarm: SWARM-parallel training over unreliable peers."""
