"""The Action Guard (a learned veto) and the rule engine (the declarative fallback)."""
