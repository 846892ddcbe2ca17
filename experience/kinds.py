"""The kinds of log record, by name: what the server's metrics need without loading pyarrow."""

DECISIONS_KIND = "decisions"
OUTCOMES_KIND = "outcomes"
ENGAGEMENTS_KIND = "engagements"
PRODUCTS_KIND = "products"
KINDS = (DECISIONS_KIND, OUTCOMES_KIND, ENGAGEMENTS_KIND, PRODUCTS_KIND)  # also the sub-directory names of a log directory
