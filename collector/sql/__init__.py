"""Read-only SQL: the guard, the allow-list it checks against, and the slots it runs on."""
