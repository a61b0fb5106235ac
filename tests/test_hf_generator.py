"""The local transformers backend (:class:`robustir.llm.HFGenerator`) decodes each prompt of a batch as if alone.

A batch of prompts of different lengths is padded to one width; a decoder-only model must be padded on the left so
every prompt ends at the last column and generation continues each prompt, not its padding. The test of the backend
in test_llm.py only checks that replies are strings (a constant reply would pass); these compare replies token for
token with a plain greedy loop over the model and with the same prompt generated alone.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# different lengths, so a batch of them needs padding
PROMPTS = ["hi", "write one question about the boiling point of water at high altitude",
           "a medium sized prompt about proteins", "why do cells divide"]
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory, minilm_path) -> str:
    """A 2-layer, 32-wide random GPT-2 with MiniLM's WordPiece tokenizer and a toy chat template, seeded.

    The tokenizer returns no ``token_type_ids`` (GPT-2 would add their embeddings to the prompt alone, so the model's
    reply would depend on what the tokenizer returns rather than on the tokens).

    ``initializer_range`` is large so next-token logits are far apart: the argmax cannot flip on the last-bit
    differences between a padded batch and a single prompt, and different prompts get different replies."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("tiny-gpt2")
    # as a causal LM's tokenizer: no token_type_ids
    tokenizer = AutoTokenizer.from_pretrained(minilm_path, model_input_names=["input_ids", "attention_mask"])
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        initializer_range=0.5, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]{% endif %}")
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def generator(tiny_lm_dir):
    from robustir.llm import HFGenerator

    return HFGenerator(tiny_lm_dir, max_new_tokens=MAX_NEW_TOKENS, batch_size=len(PROMPTS), device="cpu")


def greedy_reference(generator, conversation) -> str:
    """Greedy decoding of one unpadded prompt by hand (argmax of the model's next-token logits, stop at eos)."""
    import torch

    tokenizer, lm = generator.tokenizer, generator.lm
    ids = tokenizer(generator.render(conversation), return_tensors="pt", add_special_tokens=False)["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            token = int(lm(input_ids=ids).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def test_a_prompt_alone_gets_the_models_own_greedy_reply(generator):
    # a reply that does not come from the model (a constant, an echo) fails here
    alone = [generator.complete([p])[0] for p in PROMPTS]
    assert alone == [greedy_reference(generator, p) for p in PROMPTS]
    assert len(set(alone)) == len(PROMPTS) and all(alone)  # the check is not vacuous: replies differ


def test_a_batched_reply_equals_the_reply_to_the_prompt_alone(generator):
    widths = {len(generator.tokenizer(generator.render(p), add_special_tokens=False)["input_ids"]) for p in PROMPTS}
    assert len(widths) == len(PROMPTS)  # the batch is padded
    batched = generator.complete(PROMPTS)  # one batch of four
    alone = [generator.complete([p])[0] for p in PROMPTS]
    assert batched == alone
    assert len(set(batched)) == len(PROMPTS)
