"""Train a small random-init Hugging Face Llama with adahop on CPU, save it, load it back.

    python examples/hf_llama.py --steps 30 --out /tmp/hf_llama_adahop   # under a minute on two CPU cores

The data is synthetic and learnable: each sequence counts modulo the vocabulary from a random
start with a random stride, so the next token follows from the previous two.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import adahop
from adahop.integrations.transformers import from_pretrained, save_pretrained


def batch(n: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    return (start + stride * torch.arange(length)) % vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--recipe", default=adahop.DEFAULT_RECIPE)
    p.add_argument("--calibration-steps", type=int, default=10)
    p.add_argument("--out", default="hf_llama_adahop")
    args = p.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    recipe = {"name": args.recipe, "calibration_steps": args.calibration_steps}
    model = adahop.convert_model(LlamaForCausalLM(config), recipe)  # lm_head stays nn.Linear
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        tokens = batch(8, 32, config.vocab_size, gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")

    save_pretrained(model, args.out)  # plain transformers weights + adahop_plan.json
    restored = from_pretrained(LlamaForCausalLM, args.out, recipe)
    model.eval(), restored.eval()
    with torch.no_grad():
        same = torch.equal(model(input_ids=tokens).logits, restored(input_ids=tokens).logits)
    print(f"saved to {args.out}; {len(adahop.model_plan(restored))} layers frozen; reloaded logits identical: {same}")


if __name__ == "__main__":
    main()
