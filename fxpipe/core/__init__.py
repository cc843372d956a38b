"""Small types and helpers every layer shares: micro-batch trees, scoped values, state snapshots."""
