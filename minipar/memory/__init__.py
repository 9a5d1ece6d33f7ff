"""Memory: where training bytes live, counted (ledger), predicted (planner), moved (chunks, offload)."""
