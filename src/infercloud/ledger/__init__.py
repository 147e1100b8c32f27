"""The cost ledger, tasks and their outcomes, pricing plans and reports."""
