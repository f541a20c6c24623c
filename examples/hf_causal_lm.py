"""A transformers GPT-2 trained as its users write it, sharded: `ddpkit run -n 2 examples/hf_causal_lm.py
--checkpoint-dir runs/gpt2 --max-steps 30`, then `python examples/hf_causal_lm.py --checkpoint-dir runs/gpt2
--max-steps 40 --save-pretrained runs/gpt2-final` goes on in one process and saves it for `from_pretrained`.

Needs the `hf` extra (`pip install -e '.[hf]'`). The model is built from a config (nothing is downloaded) and reads
bytes: the text is the first files of Python's standard library, in sequences of 64 bytes. Batches are dicts
(`input_ids`, `labels`), as transformers' data collators make them; the model computes its own loss from
`labels`; validation reports loss, perplexity and token accuracy, each sequence gathered as 3 numbers, not its
logits. No step is overridden.
"""

import argparse
import os
import pathlib

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import GPT2Config, GPT2LMHeadModel

import ddpkit

LENGTH = 64  # bytes a sequence


class Bytes(Dataset):
    """``sequences`` sequences of the standard library's source, as a causal language model's batches want them."""

    def __init__(self, sequences: int = 600) -> None:
        files = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))
        text = b"".join(path.read_bytes() for path in files[:40])[: sequences * LENGTH]
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long().view(sequences, LENGTH)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # the labels are the inputs: the model shifts them, each position predicting the next byte
        return {"input_ids": self.data[index], "labels": self.data[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's own; 0 to end where one process does")
    parser.add_argument("--save-pretrained", default=None, help="a directory for save_pretrained, at the end")
    args = parser.parse_args()

    data = Bytes()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=LENGTH, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    loop = ddpkit.TrainLoop(
        model,
        DataLoader(Subset(data, range(500)), batch_size=4, shuffle=True),
        DataLoader(Subset(data, range(500, 600)), batch_size=10),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6),  # eps: see docs/sharded.md
        plugin=ddpkit.FSDPPlugin(),  # its units: the model's own _no_split_modules (the GPT2Blocks)
        global_batch_size=24,  # the same steps on 1, 2, 3, 4, 6, 8, 12 or 24 ranks
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=10,
        evaluate_every=20,
        progress=False,
    )
    history = loop.fit(max_steps=args.max_steps)
    weights = loop.full_state_dict()  # every rank calls it; rank 0 gets the whole weights
    if ddpkit.get_rank() == 0:
        print(
            f"after step {loop.global_step}: validation loss {history['eval_loss'][-1]:.4f}, perplexity "
            f"{history['eval_perplexity'][-1]:.3f}, token accuracy {history['eval_token_accuracy'][-1]:.4f}"
        )
        if args.save_pretrained:
            model.save_pretrained(args.save_pretrained, state_dict=weights)  # GPT2LMHeadModel.from_pretrained(...)


if __name__ == "__main__":
    main()
