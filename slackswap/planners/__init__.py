"""Planners: (graph, hardware, budget_bytes) -> Plan. One module per strategy, behind a registry."""
