"""KV layouts, the host pool, the device hot buffer, resolve, device-budget accounting, the planner."""
