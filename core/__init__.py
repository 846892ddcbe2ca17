"""The bottom layer every package may import: domain types (actions, pages, requests,
decisions) and the declarative conditions that guardrails and rules are written in. No I/O.
"""
