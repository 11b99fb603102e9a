"""The default model's corpus and tokenizer: the Python 3.11 documentation, as text.

Source: Debian package **python3.11-doc**, version **3.11.2-6+deb12u9** (bookworm-security, arch
all; .deb sha256 5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be, also recorded in
`manifest.json`), fetched with `apt-get download python3.11-doc`. It holds the HTML docs built by
Sphinx, which ships every page's reStructuredText source as
`usr/share/doc/python3.11/html/_sources/**/*.rst.txt` (497 files, 11.0 MB): those are the corpus.
Result: train 471 documents, 9,427,403 bytes, 2,379,135 tokens; held-out 26 documents, 575,662
bytes, 151,930 tokens (tokens of this tokenizer, one `<|endoftext|>` per document included).

Licence: the Python documentation is under the **PSF License Agreement** (version 2); code examples,
recipes and other code in it are dual-licensed under the PSF licence and the **Zero-Clause BSD**
licence (the docs' own `license.rst`, "Terms and conditions"; Debian's `copyright` file of the
package gives the full PSF, BeOpen, CNRI and CWI texts). PSF licence clauses 2 and 3 ask a
derivative to retain "Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved"
and to summarise its changes: `NOTICE.txt` (written beside the corpus) does both, and the package's
`copyright` file is copied there verbatim.

Preparation, in this order (deterministic: no randomness, files in sorted path order):
 1. `dpkg-deb -x` the .deb; take every `_sources/**/*.rst.txt`; the document id is its path
    below `_sources` without `.rst.txt` (e.g. `library/json`).
 2. Decode UTF-8 (strict), newlines to `\\n`, Unicode NFC, tabs expanded to 8 columns.
 3. Substitutions `.. |name| replace:: text` of a file are applied to its `|name|` / `|name|_`
    references; `|version|` -> 3.11, `|release|` -> 3.11.2.
 4. Explicit markup (`.. ` at any indent), with its block (the lines indented deeper, blank lines
    inside it included):
    * comments, hyperlink targets (`.. _label:`) and substitution definitions: dropped, block too;
    * directives in `DROPPED_DIRECTIVES` (index, toctree, module, audit-event, include ...):
      dropped, block too;
    * any other directive: its option lines (`:name: value` right below it) are dropped, its
      marker line becomes the header of `header()` (e.g. `.. function:: len(s)` -> `len(s)`,
      `.. versionadded:: 3.2` -> `New in version 3.2.`, `.. note::` -> `Note:`, code directives ->
      nothing), and its body is kept as it is, nested markup handled the same way;
    * footnotes `.. [#x] text` -> `[x] text`.
 5. Inline markup: `` `title <target>`_ `` and `` `text`_ `` -> the text; roles
    `:role:`text`` by `render_role()` (`:func:`len`` -> `` `len()` ``, `:class:`~a.B`` -> `` `B` ``,
    `:pep:`8`` -> `PEP 8`, `:ref:`label`` -> the title of the section the label marks, found in the
    whole corpus); inline literals ``` ``x`` ``` -> `` `x` ``; footnote references `[#x]_` -> `[x]`;
    escaped spaces (`\\ `) removed.
 6. Lines: section adornments (one punctuation character repeated, >= 3, from column 0) dropped;
    a line `::` dropped, a trailing ` ::` dropped, a trailing `::` -> `:` (Sphinx's rendering of
    literal-block markers); trailing spaces stripped; runs of blank lines -> one; leading and
    trailing blank lines dropped. Empty documents are dropped.
 7. Split by document: held out iff int(sha256(id)[:8], 16) % 20 == 0 (about 5%).
 8. `train.txt` / `heldout.txt`: the documents of each split in id order, separated by two blank
    lines (a document has at most one blank line in a row, so `\\n\\n\\n` splits them back).

Tokenizer (`train_tokenizer`): byte-level BPE trained with `tokenizers` on train.txt, vocabulary
8192 including the special tokens `<|endoftext|>` (id 0: bos, eos and document separator) and
`<|pad|>` (id 1); the pre-tokenizer splits as Qwen2's regex (single digits, runs of spaces kept
for indentation), then maps bytes to the byte-level alphabet; encoding with special tokens
prepends `<|endoftext|>` (the model saw it before every document). Written as `tokenizer.json`,
`tokenizer_config.json` (no chat template: plain text) and `generation_config.json` (eos 0;
sampling at temperature 0.7, top-k 40, top-p 0.95).

`python -m training.corpus OUTDIR [--deb FILE]` does all of it (it runs
`apt-get download` itself without --deb) and prints the sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

PACKAGE = "python3.11-doc"
PACKAGE_VERSION = "3.11.2-6+deb12u9"
SOURCES = "usr/share/doc/python3.11/html/_sources"
COPYRIGHT = "usr/share/doc/python3.11-doc/copyright"
PYTHON_VERSION, PYTHON_RELEASE = "3.11", "3.11.2"
HELDOUT_MODULUS = 20  # one document in 20 is held out
DOC_SEPARATOR = "\n\n\n"
VOCAB_SIZE = 8192
EOT, PAD = "<|endoftext|>", "<|pad|>"
SPECIAL_TOKENS = (EOT, PAD)  # ids 0 and 1
# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen/Qwen2 and later).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

DROPPED_DIRECTIVES = frozenset({
    "index", "highlight", "highlightlang", "toctree", "module", "currentmodule", "moduleauthor",
    "sectionauthor", "testsetup", "testcleanup", "audit-event", "tabularcolumns", "include",
    "literalinclude", "contents", "image", "figure", "raw", "only", "miscnews", "limited-api-list",
    "program", "default-role", "role", "meta", "c:namespace"})
# Marker replaced by nothing; the body (code, table rows, glossary) stays.
BARE_DIRECTIVES = frozenset({
    "code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "parsed-literal",
    "list-table", "table", "csv-table", "glossary", "epigraph", "centered", "hlist"})
ADMONITIONS = {"note": "Note:", "warning": "Warning:", "important": "Important:",
               "caution": "Caution:", "tip": "Tip:", "hint": "Hint:", "attention": "Attention:",
               "danger": "Danger:", "error": "Error:", "seealso": "See also:",
               "impl-detail": "CPython implementation detail:", "availability": "Availability:"}
# Object descriptions shown with a prefix, as Sphinx renders them; other directives: the argument.
SIGNATURE_PREFIXES = {"class": "class ", "exception": "exception ", "decorator": "@",
                      "decoratormethod": "@", "coroutinefunction": "coroutine ",
                      "coroutinemethod": "coroutine ", "awaitablefunction": "awaitable ",
                      "abstractmethod": "abstractmethod ", "classmethod": "classmethod ",
                      "staticmethod": "staticmethod ", "c:struct": "struct "}
CALL_ROLES = frozenset({"func", "meth"})  # also c:func (the domain is dropped); Sphinx adds "()"
PROSE_ROLES = frozenset({"ref", "doc", "term", "dfn", "emphasis", "strong", "sup", "sub",
                         "menuselection", "guilabel", "abbr", "any", "title-reference"})

_EXPLICIT = re.compile(r"^(\s*)\.\.(?:\s+(.*))?$")
_DIRECTIVE = re.compile(r"^([\w:.-]+)::(?:\s+(.*))?$")
_OPTION = re.compile(r"^\s+:[\w-]+:(\s|$)")
_SUBST_DEF = re.compile(r"^\.\.\s+\|([^|]+)\|\s+replace::\s+(.*)$")
_ROLE = re.compile(r"(?::[\w.+-]+)?:([\w.+-]+):`((?:[^`\\\n]|\\.|\n(?!\n))+?)`")
# Inline markup may continue on the next line of its paragraph, never across a blank line.
_LINK = re.compile(r"`((?:[^`<\n]|\n(?!\n))*?)\s*<[^`>]*>`__?")
_LINK_PLAIN = re.compile(r"(?<![`:\w])`((?:[^`\n]|\n(?!\n))+)`__?(?!\w)")
_LITERAL = re.compile(r"``((?:[^`\n]|\n(?!\n)|`(?!`))+?)``")
_FOOTNOTE_REF = re.compile(r"\s?\[#?([\w-]*)\]_")
_TITLED = re.compile(r"^(.*?)\s*<([^<>]+)>$", re.S)
_ADORNMENT = re.compile(r"^([=\-~^\"'*+#<>:_.`])\1{2,}$")


def extract_sources(deb: Path, into: Path) -> dict[str, str]:
    """{document id: raw text} of every `_sources/**/*.rst.txt` in the .deb (steps 1-2)."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    root = into / SOURCES
    docs = {}
    for path in sorted(root.rglob("*.rst.txt")):
        doc_id = path.relative_to(root).as_posix()[:-len(".rst.txt")]
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        docs[doc_id] = "\n".join(line.expandtabs(8) for line in
                                 unicodedata.normalize("NFC", text).split("\n"))
    return docs


def section_titles(docs: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """({label: title of the section it marks}, {document id: its first title}), raw rst."""
    labels, firsts = {}, {}
    for doc_id, text in docs.items():
        lines, pending = text.split("\n"), []
        for i, line in enumerate(lines):
            target = re.match(r"^\.\. _([^:`]+):\s*$", line)
            if target:
                pending.append(target.group(1).strip().lower())
                continue
            underline = lines[i + 1] if i + 1 < len(lines) else ""
            is_title = (line.strip() and not _ADORNMENT.match(line) and _ADORNMENT.match(underline)
                        and len(underline) >= len(line.strip()))
            if is_title:
                title = render_inline(line.strip(), {}, {})
                firsts.setdefault(doc_id, title)
                for label in pending:
                    labels.setdefault(label, title)
                pending = []
            elif line.strip() and not _ADORNMENT.match(line):
                pending = []
    return labels, firsts


def render_role(role: str, content: str, labels: dict[str, str], firsts: dict[str, str]) -> str:
    """The text Sphinx would show for `:role:`content`` (step 5)."""
    role = role.removeprefix("py:")
    content = content.replace("\\`", "`")
    titled = _TITLED.match(content)
    if titled and role != "samp":
        return titled.group(1) if role in PROSE_ROLES else f"`{titled.group(1)}`"
    if role == "ref":
        return labels.get(content.lower(), content)
    if role == "doc":
        return firsts.get(content.lstrip("/"), content)
    if role == "abbr":
        return re.sub(r"\s*\(.*\)$", "", content, flags=re.S)
    if role in PROSE_ROLES:
        return content
    if role in ("pep", "rfc"):
        return f"{role.upper()} {content.split('#')[0]}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{content}"
    text = content.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    if role in CALL_ROLES and not text.endswith(")"):
        text += "()"
    return f"`{text}`"


def render_inline(line: str, labels: dict[str, str], firsts: dict[str, str]) -> str:
    # Role and literal output is marked with NUL, not a backquote, until the link rules have run.
    line = _ROLE.sub(lambda m: render_role(m.group(1), m.group(2), labels, firsts).replace(
        "`", "\x00"), line)
    line = _LITERAL.sub(lambda m: "\x00" + m.group(1) + "\x00", line)
    line = _LINK.sub(lambda m: m.group(1), line)
    line = _LINK_PLAIN.sub(lambda m: m.group(1), line)
    line = _FOOTNOTE_REF.sub(lambda m: f" [{m.group(1)}]" if m.group(0)[0] == " "
                             else f"[{m.group(1)}]", line)
    return line.replace("\x00", "`").replace("\\ ", "")


def header(name: str, argument: str) -> str | None:
    """The line a kept directive's marker becomes (None: no line), as Sphinx's text output."""
    if name in BARE_DIRECTIVES:
        return None
    if name in ADMONITIONS:
        return f"{ADMONITIONS[name]} {argument}".rstrip()
    if name == "versionadded":
        version, _, rest = argument.partition(" ")
        return f"New in version {version}. {rest}".rstrip()
    if name == "versionchanged":
        version, _, rest = argument.partition(" ")
        return f"Changed in version {version}: {rest}".rstrip()
    if name == "deprecated":
        version, _, rest = argument.partition(" ")
        return f"Deprecated since version {version}: {rest}".rstrip()
    if name == "deprecated-removed":
        parts = argument.split(" ", 2) + ["", ""]
        return (f"Deprecated since version {parts[0]}, will be removed in version {parts[1]}: "
                f"{parts[2]}").rstrip()
    return (SIGNATURE_PREFIXES.get(name, "") + argument) or None


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """Index after the block of the markup at `start`: deeper-indented lines and the blank lines
    between them (trailing blank lines are not part of it)."""
    end = i = start + 1
    while i < len(lines):
        if lines[i].strip():
            if len(lines[i]) - len(lines[i].lstrip()) <= indent:
                break
            end = i + 1
        i += 1
    return end


def normalise(text: str, labels: dict[str, str], firsts: dict[str, str]) -> str:
    """One document's rst as plain text (steps 3-6)."""
    substitutions = {"version": PYTHON_VERSION, "release": PYTHON_RELEASE}
    for line in text.split("\n"):
        m = _SUBST_DEF.match(line)
        if m:
            substitutions[m.group(1)] = m.group(2).strip()
    text = re.sub(r"\|([^|\s][^|]*)\|_?",
                  lambda m: substitutions.get(m.group(1), m.group(0)), text)
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        m = _EXPLICIT.match(line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent, rest = len(m.group(1)), (m.group(2) or "")
        directive = _DIRECTIVE.match(rest)
        footnote = re.match(r"^\[#?([^\]]*)\]\s*(.*)$", rest)
        if footnote and not directive:
            out.append(" " * indent + f"[{footnote.group(1)}] {footnote.group(2)}".rstrip())
            i += 1
        elif not directive or directive.group(1) in DROPPED_DIRECTIVES:
            i = _block_end(lines, i, indent)  # comment, target, substitution, dropped directive
        else:
            name, argument = directive.group(1), (directive.group(2) or "").strip()
            head = header(name, argument)
            if head is not None:
                out.append(" " * indent + head)
            i += 1
            while i < len(lines) and lines[i].strip() and _OPTION.match(lines[i]):
                i += 1
    kept = []
    for line in render_inline("\n".join(out), labels, firsts).split("\n"):  # roles span lines
        line = line.rstrip()
        if _ADORNMENT.match(line):
            continue
        if line.endswith("::"):
            if line.strip() == "::":
                continue
            line = line[:-3].rstrip() if line.endswith(" ::") else line[:-1]
        if line or (kept and kept[-1]):
            kept.append(line)
    return "\n".join(kept).strip("\n")


def is_heldout(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def build_corpus(deb: Path, outdir: Path) -> dict:
    """Steps 1-8: writes train.txt, heldout.txt, NOTICE.txt, copyright, manifest.json."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = extract_sources(deb, Path(tmp))
        (outdir / "copyright").write_bytes((Path(tmp) / COPYRIGHT).read_bytes())
    labels, firsts = section_titles(raw)
    docs = {doc_id: normalise(text, labels, firsts) for doc_id, text in raw.items()}
    docs = {doc_id: text for doc_id, text in docs.items() if text}
    splits = {"train": [d for d in docs if not is_heldout(d)],
              "heldout": [d for d in docs if is_heldout(d)]}
    manifest = {"package": PACKAGE, "version": _deb_version(deb),
                "deb_sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                "source_files": len(raw),
                "source_bytes": sum(len(t.encode()) for t in raw.values()),
                "splits": {}}
    for split, ids in splits.items():
        data = (DOC_SEPARATOR.join(docs[d] for d in ids) + "\n").encode("utf-8")
        (outdir / f"{split}.txt").write_bytes(data)
        manifest["splits"][split] = {"documents": ids, "bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
    (outdir / "NOTICE.txt").write_text(NOTICE.format(version=manifest["version"]))
    (outdir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


NOTICE = """\
Text derived from the Python 3.11 documentation, Debian package python3.11-doc {version}.
Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.
Licensed under the PSF License Agreement for Python 3.11 (code in the documentation also under
the Zero-Clause BSD licence); the full texts are in `copyright` beside this file, from the package.
Changes (PSF licence clause 3): the reStructuredText sources were converted to plain text
(markup removed or rendered as Sphinx renders it; index entries, comments, labels and author
lines dropped) and split into train / held-out sets by document, as fermijit's
training/corpus.py describes; a language model and tokenizer were trained on the text.
"""


def _deb_version(deb: Path) -> str:
    out = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def read_documents(path: Path) -> list[str]:
    """The documents of a split file written by `build_corpus`."""
    return path.read_text(encoding="utf-8").rstrip("\n").split(DOC_SEPARATOR)


def train_tokenizer(documents: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE on `documents` (deterministic: `tokenizers` breaks count ties by pair)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    # Training puts <|endoftext|> before every document, so a prompt starts with it too.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1",
        special_tokens=[(EOT, tokenizer.token_to_id(EOT))])
    return tokenizer


def write_tokenizer(tokenizer, outdir: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (plain text, no chat template) and
    generation_config.json."""
    eot, pad = tokenizer.token_to_id(EOT), tokenizer.token_to_id(PAD)
    tokenizer.save(str(outdir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
              "pad_token": PAD, "unk_token": None, "add_bos_token": True,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length}
    (outdir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Sampling by default: greedy decoding of a model this small falls into loops.
    generation = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": pad,
                  "do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.95}
    (outdir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.corpus",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--deb", type=Path, default=None,
                        help=f"the {PACKAGE} .deb (default: apt-get download it)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--max-length", type=int, default=512,
                        help="model_max_length written to tokenizer_config.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
            deb = next(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        manifest = build_corpus(deb.resolve(), args.outdir)
    if manifest["version"] != PACKAGE_VERSION:
        print(f"note: {PACKAGE} is {manifest['version']}, the documented preparation used "
              f"{PACKAGE_VERSION}", file=sys.stderr)
    train = read_documents(args.outdir / "train.txt")
    tokenizer = train_tokenizer(train, args.vocab_size)
    write_tokenizer(tokenizer, args.outdir, args.max_length)
    manifest["tokenizer"] = {"vocab_size": tokenizer.get_vocab_size(),
                             "sha256": hashlib.sha256(
                                 (args.outdir / "tokenizer.json").read_bytes()).hexdigest()}
    for split in manifest["splits"]:
        docs = read_documents(args.outdir / f"{split}.txt")
        encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
        n_tokens = sum(len(e.ids) for e in encodings) + len(docs)  # + one EOT each
        manifest["splits"][split]["tokens"] = n_tokens
    (args.outdir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for split, info in manifest["splits"].items():
        print(f"{split}: {len(info['documents'])} documents, {info['bytes']} bytes, "
              f"{info['tokens']} tokens (with one {EOT} per document)")
    print(f"tokenizer: {manifest['tokenizer']['vocab_size']} tokens -> {args.outdir}")


if __name__ == "__main__":
    main()
