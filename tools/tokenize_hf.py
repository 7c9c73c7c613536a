#!/usr/bin/env python3
"""Text to llm.c token shards with the GPT-2 or a Hugging Face (Llama) tokenizer.

usage: python3 tools/tokenize_hf.py --tokenizer gpt2|bytes|PATH [--val-fraction F]
                                    [--shard-tokens N] [--no-separator] TEXT... OUT_PREFIX

writes OUT_PREFIX_val.bin (the last F of the tokens, default 0.05: the split the training
binary makes of a text --data without --val) and OUT_PREFIX_train_000000.bin, ... (the rest,
at most N tokens each, default 100M), as fp8c-tokenize does for the byte-level tokenizer.

Tokenizers:
  gpt2   GPT-2's BPE through tiktoken (pip install tiktoken); documents (the TEXT files) are
         separated by <|endoftext|> (50256), which also starts the first, as llm.c does.
  PATH   a tokenizer.json, or a directory holding one (a Hugging Face model directory, the
         same one given to --init), through the `tokenizers` package (pip install tokenizers);
         each document starts with the tokenizer's BOS token (<s>, <|begin_of_text|>) when it
         has one.
  bytes  token = byte value, vocabulary 256: the same shards fp8c-tokenize writes.
--no-separator leaves out the separator / BOS tokens.

Shards are llm.c's (dev/data/data_common.py, write_datafile): a header of 256 little-endian
int32 (magic, version, token count), then the tokens: uint16 under magic 20240520 version 1
when every id fits (GPT-2, Llama 2), uint32 under magic 20240801 version 7 otherwise
(Llama 3's 128256). The model's vocabulary must hold the tokenizer's: build GPT-2 with
`-D vocab=50257` (or keep the padded 50304) and Llama with the vocab_size of its config.json.

This tool is not part of the C build: the training binary never needs Python.
"""
import argparse
import array
import json
import os
import struct
import sys

PROG = os.path.basename(sys.argv[0])
SHARD_HEADER_INTS = 256
FORMATS = {  # width -> (magic, version, array type)
    2: (20240520, 1, "H"),
    4: (20240801, 7, "I"),
}


def fail(what, status=1):
    print(f"{PROG}: error: {what}", file=sys.stderr)
    sys.exit(status)


class Bytes:
    name = "bytes"
    vocab = 256
    separator = None

    def encode(self, raw):
        return list(raw)


class Gpt2:
    name = "gpt2"

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            fail("--tokenizer gpt2: the tiktoken package is not installed (pip install tiktoken)")
        self.enc = tiktoken.get_encoding("gpt2")
        self.vocab = self.enc.n_vocab
        self.separator = self.enc.eot_token

    def encode(self, raw):
        return self.enc.encode_ordinary(raw.decode("utf-8", "replace"))


class HfTokenizer:
    def __init__(self, path):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            fail(f"{path}: no tokenizer.json (give gpt2, bytes, a tokenizer.json or a model "
                 "directory holding one)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            fail(f"{file}: the tokenizers package is not installed (pip install tokenizers)")
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as e:  # the library's own message, on one line
            fail(f"{file}: not a tokenizer: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        self.name = file
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.separator = None
        config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        bos = None
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                bos = json.load(f).get("bos_token")
            if isinstance(bos, dict):
                bos = bos.get("content")
        for candidate in ([bos] if bos else []) + ["<s>", "<|begin_of_text|>"]:
            tid = self.tok.token_to_id(candidate)
            if tid is not None:
                self.separator = tid
                break

    def encode(self, raw):
        return self.tok.encode(raw.decode("utf-8", "replace"), add_special_tokens=False).ids


def write_shard(path, tokens):
    width = 2 if not tokens or max(tokens) < 65536 else 4
    magic, version, code = FORMATS[width]
    if len(tokens) >= 2**31:
        fail(f"{path}: {len(tokens)} tokens do not fit one shard: give a smaller --shard-tokens")
    header = [0] * SHARD_HEADER_INTS
    header[0], header[1], header[2] = magic, version, len(tokens)
    data = array.array(code, tokens)
    if sys.byteorder != "little":
        data.byteswap()
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack(f"<{SHARD_HEADER_INTS}i", *header))
            f.write(data.tobytes())
        os.replace(tmp, path)
    except OSError as e:
        fail(f"{path}: cannot write: {e.strerror}")
    print(f"{path}: {len(tokens)} tokens, uint{8 * width}")


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="gpt2, bytes, or a tokenizer.json / model directory")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--no-separator", action="store_true")
    ap.add_argument("files", nargs="+", metavar="TEXT... OUT_PREFIX")
    a = ap.parse_args()
    if len(a.files) < 2:
        fail("give one or more TEXT files and an OUT_PREFIX (see --help)", 2)
    if not 0 <= a.val_fraction < 1:
        fail(f"--val-fraction {a.val_fraction}: expected a number in [0, 1)", 2)
    if not 1 <= a.shard_tokens < 2**31:
        fail(f"--shard-tokens {a.shard_tokens}: expected an integer from 1 to {2**31 - 1}", 2)
    *texts, prefix = a.files
    tok = Bytes() if a.tokenizer == "bytes" else Gpt2() if a.tokenizer == "gpt2" else HfTokenizer(a.tokenizer)
    tokens = []
    for path in texts:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            fail(f"{path}: cannot read: {e.strerror}")
        if not raw:
            fail(f"{path}: empty file")
        if tok.separator is not None and not a.no_separator:
            tokens.append(tok.separator)
        tokens.extend(tok.encode(raw))
    n_val = int(len(tokens) * a.val_fraction)
    n_train = len(tokens) - n_val
    print(f"{tok.name}: vocabulary {tok.vocab}, {len(tokens)} tokens", file=sys.stderr)
    if n_val > 0:
        write_shard(f"{prefix}_val.bin", tokens[n_train:])
    for k, at in enumerate(range(0, n_train, a.shard_tokens)):
        write_shard(f"{prefix}_train_{k:06d}.bin", tokens[at:min(at + a.shard_tokens, n_train)])


if __name__ == "__main__":
    main()
