"""Generate text from a checkpoint, in one process.

    python -m titanlite.generate CKPT [--format dcp|hf] [--prompt TEXT ...] [--prompts FILE.jsonl] [--chat]
        [--max_new_tokens 64] [--temperature 0] [--top_k 0] [--top_p 1] [--min_p 0] [--seed 0]
        [--stop TEXT ...] [--out FILE.json] [--tokenizer byte|byte_chat|FOLDER]

CKPT is a titanlite checkpoint step folder (a LoRA run's: its adapter applied to the base it
records) or, with --format hf, a transformers folder. Prompts come from --prompt (repeatable),
--prompts (JSON lines: a string, or an object with "prompt"), else stdin (one prompt a line).
--chat renders each prompt as a user turn with the tokenizer's chat template and the generation
prompt. Each prompt's text goes to stdout as one block; --out writes, per prompt, its token ids,
the generated ids and the text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.data.sources import jsonl_rows
from titanlite.errors import ConfigError
from titanlite.generate import Sampling, generate
from titanlite.generate.load import check_tp_degree, eos_ids, load_model, load_tokenizer, read_model_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titanlite.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--format", default="dcp", choices=("dcp", "hf"), help="dcp: a titanlite step folder; hf: transformers'")
    p.add_argument("--model", default="", help="family reading a transformers folder (default: by its model_type)")
    p.add_argument("--tokenizer", default="", help="byte, byte_chat or a folder (default: a transformers "
                   "folder's own, the one a step folder's run trained with, else byte)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default="", help="a JSON-lines file of prompts")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user turn of a chat")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--min_p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompt i draws from (seed, i)")
    p.add_argument("--stop", action="append", default=[], help="a string that ends a generation (repeatable)")
    p.add_argument("--out", default="", help="write the prompts' and generations' ids and text here (JSON)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel over this many ranks (torchrun "
                   "--nproc_per_node N): the training plan's sharding")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"), help="default: as saved")
    return p


def read_prompts(a: argparse.Namespace) -> list[str]:
    """--prompt texts, then --prompts' lines; neither: stdin's lines."""
    prompts = list(a.prompt)
    if a.prompts:
        path = Path(a.prompts)
        if not path.is_file():
            raise ConfigError(f"--prompts {path}: no such file; give a JSON-lines file of prompts")
        for n, row in jsonl_rows(path, "--prompts"):
            text = row.get("prompt") if isinstance(row, dict) else row
            if not isinstance(text, str):
                raise ConfigError(f'--prompts {path}:{n}: neither a string nor an object with a "prompt" string')
            prompts.append(text)
    if not prompts and not a.prompt and not a.prompts:
        prompts = [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT, --prompts FILE.jsonl or lines on stdin")
    return prompts


def check_options(a: argparse.Namespace) -> Sampling:
    """The sampling options, refused in one line naming the flag where out of range."""
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens {a.max_new_tokens}: generate one token at least")
    try:
        return Sampling(a.temperature, a.top_k, a.top_p, a.min_p)
    except ValueError as e:
        raise ConfigError(f"--{e}") from None


def encode(tokenizer, name: str, prompts: list[str], chat: bool) -> list[list[int]]:
    """Each prompt's ids: a user turn and the generation prompt through the chat template with
    --chat, else BOS (where the tokenizer has its own) and the text, as training saw documents."""
    if not chat:
        head = [tokenizer.bos_id] if tokenizer.bos_id != tokenizer.eos_id else []
        return [head + tokenizer.encode(p) for p in prompts]
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ConfigError(f"--chat: tokenizer '{name}' has no chat template; use --tokenizer byte_chat, or a "
                          "tokenizer folder whose tokenizer_config.json (or chat_template.jinja) has one")
    texts = [hf.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    return [tokenizer.encode(t) for t in texts]


def check_prompts(ids: list[list[int]], args, name: str, tp: int) -> None:
    """Refuse, before any weight is read, prompts the model cannot take and a --tp its heads refuse."""
    context = getattr(args, "context_len", 0) or args.max_seq_len
    for i, p in enumerate(ids):
        if len(p) >= context:
            raise ConfigError(f"prompt {i} is {len(p)} tokens, the model's context is {context}; shorten it to "
                              f"{context - 1} tokens at most")
    if max(max(p, default=0) for p in ids) >= args.vocab_size:
        raise ConfigError(f"tokenizer '{name}' gives ids past the model's vocabulary ({args.vocab_size}); "
                          "use the tokenizer the model was trained with (--tokenizer)")
    check_tp_degree(args, tp)


def start_ranks(tp: int, device: str) -> torch.device:
    """With --tp > 1, join the process group torchrun launched (gloo on CPU, nccl on CUDA, one
    device a rank); the device this rank generates on."""
    if tp <= 1:
        return torch.device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) != tp:
        raise ConfigError(f"--tp {tp} runs as {tp} ranks: launch it with torchrun --nproc_per_node {tp}")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return torch.device(device)


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    try:
        sampling = check_options(a)
        path = Path(a.checkpoint)
        prompts = read_prompts(a)
        tokenizer, name = load_tokenizer(a.tokenizer, path, a.format)
        ids = encode(tokenizer, name, prompts, a.chat)
        check_prompts(ids, read_model_args(path, a.format, a.model)[1], name, a.tp)  # before the ranks start
        device = start_ranks(a.tp, a.device)
        model, _, _ = load_model(path, a.format, a.model, device, getattr(torch, a.dtype) if a.dtype else None, a.tp)
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        out = generate(model, ids, a.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
                       sampling.min_p, a.seed, eos_ids(tokenizer, path, a.format), a.stop, tokenizer.decode, pad)
    except (ConfigError, ValueError) as e:
        sys.exit(f"titanlite: error: {e}")
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank > 0:
            return  # every rank drew the same tokens: rank 0 says them
    for i, (prompt, g) in enumerate(zip(prompts, out)):
        print(f"--- prompt {i} ({len(g.prompt_ids)} tokens; {len(g.ids)} generated, {g.finish}): {prompt!r}")
        print(g.text)
    if a.out:
        rows = [{"prompt": p, "prompt_ids": g.prompt_ids, "ids": g.ids, "text": g.text, "finish": g.finish}
                for p, g in zip(prompts, out)]
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
