"""ZeRO proper: units and their placement, the sharded state, gathering, reduction, updates."""
