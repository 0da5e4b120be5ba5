"""Stand-in until the pricing package lands: the rate card's names, re-exported."""
from lab_helpers.calcul_forfaits import (CARD_NAME, DURATIONS_DAYS, ILLUSTRATIVE_NOTICE, MAX_ACCEPTED_RESULTS, NOTICE,
                                         ForfaitError, is_illustrative, load_card)
from lab_helpers.core.paths import REPOSITORY

RATE_CARD_PATH = REPOSITORY / "data" / CARD_NAME
