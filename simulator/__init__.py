"""The shopper simulator's world model: seeded shoppers, items and their reactions (see ``world``)."""

from simulator.config import DEFAULT_INTENTS, SERVABLE, Intent, IntentProfile, SimConfig, effect_table
from simulator.items import Catalogue
from simulator.world import OutcomeEvent, PageView, ShopperSession, World

__all__ = [
    "DEFAULT_INTENTS", "SERVABLE", "Catalogue", "Intent", "IntentProfile", "OutcomeEvent", "PageView", "ShopperSession",
    "SimConfig", "World", "effect_table",
]
