"""Assistant-only loss masks under the real SmolLM2 chat template (ChatML)."""

import pytest
from test_chat import MULTI_TURN, assert_mask_is_assistant_only

from specdec.data.chat import tokenize_chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdec.target import FrozenTarget

    return FrozenTarget.load("smollm2-135m-instruct").tokenizer


@pytest.mark.parametrize("turns", [3, 5, 7])
def test_smollm2_mask_covers_assistant_turns_only(smollm2_tokenizer, turns):
    messages = MULTI_TURN[:turns]
    encoded = tokenize_chat(messages, smollm2_tokenizer, max_length=4096)
    assert_mask_is_assistant_only(messages, encoded, smollm2_tokenizer, end_of_turn="<|im_end|>")
    # system and user turns and every header stay unmasked
    assert sum(encoded["loss_mask"]) < len(encoded["input_ids"]) / 2
