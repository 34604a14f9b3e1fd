"""interop/tokenizer_files.py — tokenizers from files: ours (tokenizer.json, a byte-level BPE trained on the corpus),
Megatron's --tokenizer-type from local files, a Hugging Face folder's tokenizer and its chat template.

Mirrors Megatron-LM's megatron/training/tokenizer/tokenizer.py (build_tokenizer: the types and the files each reads)
and transformers' apply_chat_template (utils/chat_template_utils.py). data.py's corpus -> token cache pipeline asks
`get_tokenizer` (ours) or `megatron_tokenizer` (the flags'); every tokenizer here is a `tokenizers.Tokenizer` with the
data layer's roles (eod, pad, cls, sep, mask; `Roles`) attached.

    python -c "from interop import tokenizer_files as t; print(t.TOKENIZER_TYPES)"   # Megatron's types here

Nothing is downloaded: a file or a folder is read from disk, a hub name is refused (arguments.check_data_args).
"""
import dataclasses
import datetime
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


class DataError(ValueError):
    """Bad data input: a missing path, a malformed file. The message names the culprit."""


def note(message: str):
    """One line on rank 0: what runs instead of what a flag asked for, or a flag Megatron itself does not read here."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"note: {message}", flush=True)


# ----------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<pad>", "<cls>", "<sep>", "<mask>"] + [f"<extra_id_{i}>" for i in range(100)]
ROLES = ("eod", "pad", "cls", "sep", "mask")  # the roles of SPECIAL_TOKENS[:5]; SPECIAL_TOKENS[5:] are T5's sentinels


@dataclass(frozen=True)
class Roles:
    """What a tokenizer.json does not say and the data layer needs: the text of the token that plays each role of
    SPECIAL_TOKENS, and whether a document is encoded with the tokenizer's own post-processor. Our tokenizers spell
    the roles as SPECIAL_TOKENS does (these defaults); a Megatron --tokenizer-type maps its own tokens (BERT's [CLS] is
    cls, a Hugging Face folder's eos_token is eod). Kept on the tokenizer (`tok.roles`, read by roles_of) and saved
    beside its tokenizer.json (save_tokenizer), so a resumed run, tools.py and an export find the same roles. A Hugging
    Face folder's chat template rides along (chat_template, chat_tokens): post-training renders its conversations with
    it (recipes.encode_chat), tools.py sample --chat prompts with it and export writes it back."""
    tokenizer_type: str | None = None  # the --tokenizer-type that made the tokenizer (None: ours)
    eod: str = SPECIAL_TOKENS[0]
    pad: str = SPECIAL_TOKENS[1]
    cls: str = SPECIAL_TOKENS[2]
    sep: str = SPECIAL_TOKENS[3]
    mask: str = SPECIAL_TOKENS[4]
    add_special_tokens: bool = False  # documents: encoded with the post-processor (Megatron's HuggingFaceTokenizer)
    fixed: bool = False  # an imported model's own tokenizer (interop/hf.py): nothing is added to it, it has no sentinels
    chat_template: str | None = None  # a Hugging Face folder's own chat template (Jinja; render_chat_template)
    chat_tokens: dict = dataclasses.field(default_factory=dict)  # with it, the folder's named special tokens
    # ({"bos_token": "<s>", "eos_token": "</s>", ...}, as transformers' special_tokens_map): the template's variables


def roles_of(tok) -> Roles:
    """The tokenizer's Roles: those a --tokenizer-type gave it, else SPECIAL_TOKENS' spellings."""
    return getattr(tok, "roles", None) or Roles()


def roles_file(path) -> Path:
    """Where save_tokenizer writes a tokenizer's Roles: beside it, tokenizer.json -> tokenizer.roles.json."""
    return Path(path).with_suffix(".roles.json")


def save_tokenizer(tok, path):
    """tok.save(path), and its Roles beside it (roles_file) unless they are SPECIAL_TOKENS' own (a stale one goes)."""
    tok.save(str(path))
    side, roles = roles_file(path), roles_of(tok)
    if roles == Roles():
        side.unlink(missing_ok=True)
    else:
        side.write_text(json.dumps(dataclasses.asdict(roles), indent=1) + "\n")


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizer files tokenize alike: the same JSON once loaded (as get_tokenizer loads them)."""
    load = lambda p: json.loads(add_missing_specials(_load_tokenizer(p)).to_str())
    return Path(a).resolve() == Path(b).resolve() or load(a) == load(b)


def _load_tokenizer(path):
    """A tokenizer.json, with the Roles saved beside it (save_tokenizer) if there are any."""
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {str(path)!r} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on bad JSON)
        raise DataError(f"tokenizer file {str(path)!r} is unreadable: {str(e).splitlines()[0]}") from None
    if roles_file(path).exists():
        try:
            tok.roles = Roles(**json.loads(roles_file(path).read_text()))
        except (ValueError, TypeError) as e:
            raise DataError(f"{roles_file(path)}: not a tokenizer's roles ({e})") from None
    return tok


def add_missing_specials(tok):
    """Add, at the end of the vocabulary, the SPECIAL_TOKENS whose role no token of `tok` plays (as Megatron's BERT
    tokenizer adds [BOS], [EOS] and T5's sentinels): every model's recipe finds its roles (special_ids)."""
    roles = roles_of(tok)
    if roles.fixed:  # its vocabulary is the model's embedding: every role is one of its tokens already
        return tok
    wanted = [getattr(roles, r) for r in ROLES] + SPECIAL_TOKENS[len(ROLES):]
    tok.add_special_tokens([t for t in wanted if tok.token_to_id(t) is None])
    return tok


def get_tokenizer(documents, cache_path, vocab_size=8192, tokenizer_file=None):
    """Load tokenizer_file (adding any missing SPECIAL_TOKENS at the end of its vocab, as Megatron's BERT
    tokenizer adds T5 sentinels); else load cache_path if it exists with this vocab_size; else train a
    byte-level BPE on the documents (special tokens at ids 0..104) and save it to cache_path atomically."""
    if tokenizer_file is not None:
        return add_missing_specials(_load_tokenizer(tokenizer_file))
    if cache_path is not None and os.path.exists(cache_path):
        tok = _load_tokenizer(cache_path)
        if tok.get_vocab_size() == vocab_size:
            return tok
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise DataError(f"vocab_size {vocab_size} is too small: need >= {len(SPECIAL_TOKENS) + 256}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    if cache_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        tmp = f"{cache_path}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, cache_path)  # a killed run never leaves half a file behind
    return tok


def special_ids(tok):
    """{'eod', 'pad', 'cls', 'sep', 'mask': id, 'sentinels': [100 ids]}: the ids of the tokens that play these roles
    (roles_of: SPECIAL_TOKENS' spellings, or a --tokenizer-type's own tokens)."""
    roles = roles_of(tok)
    sentinels = [t for t in SPECIAL_TOKENS[len(ROLES):] if not roles.fixed or tok.token_to_id(t) is not None]
    names = [getattr(roles, r) for r in ROLES] + sentinels
    ids = [tok.token_to_id(t) for t in names]
    missing = [t for t, i in zip(names, ids) if i is None]
    if missing:
        raise DataError(f"tokenizer lacks special tokens {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return {**dict(zip(ROLES, ids)), "sentinels": ids[len(ROLES):]}


def tokenizer_text(tok) -> str:
    """All that makes the tokenizer encode as it does, as text (cache keys): its JSON, and its Roles if not ours."""
    roles = roles_of(tok)
    return tok.to_str() + ("" if roles == Roles() else json.dumps(dataclasses.asdict(roles)))


# ----------------------------------------------------------------------------- Megatron's tokenizer types
# --tokenizer-type (megatron/training/tokenizer/tokenizer.py build_tokenizer) from local files, each made a
# `tokenizers.Tokenizer` with its Roles, so everything downstream (the token cache, the models' recipes, a run's saved
# tokenizer.json, export) works as with ours. Nothing is downloaded. The types this file cannot read offline are
# refused (REFUSED_TOKENIZERS: the line check_args prints).

TOKENIZER_TYPES = ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"]  # Megatron's
REFUSED_TOKENIZERS = {
    "SentencePieceTokenizer": "Megatron's generic SentencePiece type adds the encoders' special tokens (<CLS>, <SEP>, "
                              "<MASK>, sentinels) after the model's pieces, which is not implemented; "
                              "GPTSentencePieceTokenizer or Llama2Tokenizer read the same .model",
    "TikTokenizer": "needs the tiktoken library, which requirements.txt does not carry",
    "MultimodalTokenizer": "the multimodal prompt formats (transformers' chat templates for images) are not "
                           "implemented; the image model here uses its own captions and tokenizer",
    "NullMultimodalTokenizer": "the multimodal prompt formats are not implemented",
    "SFTTokenizer": "--task sft has its own chat template (recipes.CHAT_TEMPLATE) on the run's tokenizer, or a "
                    "HuggingFaceTokenizer folder's own chat template",
}
TOKENIZER_FILES = {  # what each type reads (check_args: the flags it needs)
    "GPT2BPETokenizer": ("vocab_file", "merge_file"), "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",), "HuggingFaceTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",), "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",)}


def vocab_file_type(vocab_file) -> str:
    """The --tokenizer-type a --vocab-file means when none is given (Megatron's pretraining scripts default it:
    GPT2BPETokenizer for the decoders, BertWordPieceLowerCase for the encoders): a JSON object is GPT-2's vocab.json,
    anything else a WordPiece vocab.txt (one token a line)."""
    if not os.path.isfile(vocab_file):
        raise DataError(f"--vocab-file {vocab_file!r} does not exist")
    try:
        return "GPT2BPETokenizer" if isinstance(json.loads(Path(vocab_file).read_text(encoding="utf-8")), dict) \
            else "BertWordPieceLowerCase"
    except (ValueError, UnicodeDecodeError):
        return "BertWordPieceLowerCase"


def _need_file(path, flag, what):
    if path is None or not os.path.isfile(path):
        raise DataError(f"{flag} {path!r}: no such file (the {what})")


def byte_level_bpe(vocab_file, merge_file) -> Tokenizer:
    """GPT2BPETokenizer: GPT-2's byte-level BPE from its vocab.json and merges.txt, as Megatron's gpt2_tokenization.py
    encodes (GPT-2's pre-tokenizing regex, each byte as a printable character, merges by rank); eod = <|endoftext|>,
    which the vocabulary must hold."""
    _need_file(vocab_file, "--vocab-file", "byte-level BPE vocab.json")
    _need_file(merge_file, "--merge-file", "byte-level BPE merges.txt")
    try:
        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise DataError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not byte-level BPE files "
                        f"({str(e).splitlines()[0]})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(SPECIAL_TOKENS[0]) is None:
        raise DataError(f"--vocab-file {vocab_file} has no {SPECIAL_TOKENS[0]} (GPT2BPETokenizer's eod)")
    tok.roles = Roles("GPT2BPETokenizer")
    return tok


def wordpiece_tokenizer(vocab_file, lower_case: bool, extra_ids: int = 0) -> Tokenizer:
    """BertWordPieceLowerCase / BertWordPieceCase: BERT's WordPiece on a vocab.txt, as Megatron's bert_tokenization.py
    (clean the text, split CJK characters, lower-case and strip accents if lower_case, split at whitespace and
    punctuation, greedy longest-match word pieces, [UNK] for a word it cannot cut or of more than 200 characters).
    Megatron's tokenizer adds [BOS], [EOS] and `extra_ids` sentinels <extra_id_i> after the vocabulary, in this order;
    eod is its [EOS], and [PAD], [CLS], [SEP], [MASK] play pad, cls, sep, mask."""
    _need_file(vocab_file, "--vocab-file", "WordPiece vocab.txt")
    try:
        tok = Tokenizer(models.WordPiece.from_file(vocab_file, unk_token="[UNK]", max_input_chars_per_word=200))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"--vocab-file {vocab_file}: not a WordPiece vocab.txt ({str(e).splitlines()[0]})") from None
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=lower_case)  # strip_accents None: as lowercase
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]") if tok.token_to_id(t) is None]
    if missing:
        raise DataError(f"--vocab-file {vocab_file} lacks {', '.join(missing)} (the WordPiece special tokens)")
    added = ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(extra_ids)]
    tok.add_special_tokens([t for t in added if tok.token_to_id(t) is None])
    kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
    tok.roles = Roles(kind, eod="[EOS]", pad="[PAD]", cls="[CLS]", sep="[SEP]", mask="[MASK]")
    return tok


def _token_text(value):
    """A special token as tokenizer_config.json writes it: its text, or {"content": text, ...}."""
    return value.get("content") if isinstance(value, dict) else value


def folder_tokenizer(folder) -> Tokenizer:
    """HuggingFaceTokenizer: a local Hugging Face tokenizer folder (Megatron: transformers.AutoTokenizer.from_pretrained
    of --tokenizer-model): its tokenizer.json, and from tokenizer_config.json (special_tokens_map.json overriding, as
    transformers reads them) the eos_token, which is eod (Megatron's), and pad, cls, sep, mask where it names them.
    A document is encoded as Megatron's HuggingFaceTokenizer.tokenize does, with the folder's post-processor (a
    Llama 3 folder puts <|begin_of_text|> first), then eod."""
    path = Path(folder or "")
    if not path.is_dir():
        raise DataError(f"--tokenizer-model {folder!r} is not a local folder (nothing is downloaded at run time: "
                        "fetch a hub tokenizer first, e.g. with huggingface_hub.snapshot_download)")
    if not (path / "tokenizer.json").is_file():
        raise DataError(f"--tokenizer-model {folder}: no tokenizer.json there (a fast tokenizer's file: "
                        "transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one)")
    tok = _load_tokenizer(path / "tokenizer.json")
    named = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            try:
                named.update({k: _token_text(v) for k, v in json.loads((path / name).read_text()).items()
                              if k.endswith("_token") and _token_text(v)})
            except (ValueError, AttributeError) as e:
                raise DataError(f"{path / name}: unreadable ({e})") from None
    if not (named.get("eos_token") or named.get("sep_token")):
        raise DataError(f"--tokenizer-model {folder}: tokenizer_config.json names no eos_token (Megatron's "
                        "HuggingFaceTokenizer takes eod from it) and no sep_token")
    roles = {r: named[f"{k}_token"] for r, k in [("eod", "eos"), ("pad", "pad"), ("cls", "cls"), ("sep", "sep"),
                                                   ("mask", "mask")] if named.get(f"{k}_token")}
    roles.setdefault("eod", named.get("sep_token"))  # an encoder's folder (BERT): [SEP] ends a document
    absent = [t for t in roles.values() if tok.token_to_id(t) is None]
    if absent:
        raise DataError(f"--tokenizer-model {folder}: its special token {absent[0]!r} is not in its tokenizer.json")
    template = folder_chat_template(path)
    chat_tokens = {k: named[k] for k in HF_SPECIAL_TOKENS if isinstance(named.get(k), str)} if template else {}
    tok.roles = Roles("HuggingFaceTokenizer", **roles, add_special_tokens=True, chat_template=template,
                      chat_tokens=chat_tokens)
    return tok


# ----------------------------------------------------------------------------- a tokenizer folder's chat template
# transformers' apply_chat_template (utils/chat_template_utils.py, tokenization_utils_base.py), which post-training
# (recipes.encode_chat), tools.py sample --chat and export follow byte for byte: the template is Jinja in a sandbox
# with trim_blocks and lstrip_blocks (a tag's own line break and leading blanks render nothing), the loopcontrols
# extension, a tojson filter that does not escape HTML, raise_exception and strftime_now; it sees messages,
# tools=None, documents=None, add_generation_prompt and the folder's named special tokens (bos_token, eos_token, ...);
# tokenize=True encodes the rendered text whole, special tokens matched, and adds none (add_special_tokens=False).
# tests/test_chat_templates.py checks text and ids against transformers on real-world templates.
HF_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def folder_chat_template(folder) -> str | None:
    """A Hugging Face tokenizer folder's chat template, where transformers finds it: chat_template.jinja beside
    tokenizer_config.json (transformers 5 writes it there), else tokenizer_config.json's "chat_template", a string or
    a list of {"name", "template"} of which "default" is used. None if it has none."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() \
        else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{path / 'tokenizer_config.json'}: its chat templates {sorted(map(str, named))} have "
                            "none named 'default' (the one transformers applies)")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise DataError(f"{path / 'tokenizer_config.json'}: chat_template is a {type(template).__name__}, not a string")
    return template


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str):
    """The template compiled in transformers' Jinja environment (_cached_compile_jinja_template): a sandbox that
    cannot change its inputs, trim_blocks and lstrip_blocks, loopcontrols ({% break %}), {% generation %} blocks
    (transformers marks the assistant's text with them; their body renders unchanged), its tojson, raise_exception,
    strftime_now, and dict and namespace without access to private attributes."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # dict(...) and dict.fromkeys(...) only
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template does not compile: {e}") from None


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names of a message's reasoning


def render_chat_template(template: str, messages, add_generation_prompt: bool = False, **special_tokens) -> str:
    """The text of `messages` ([{'role', 'content', ...}, ...]) through the Jinja chat `template`, exactly as
    transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` renders it with a
    tokenizer whose named special tokens are `special_tokens` (Roles.chat_tokens). As transformers does, a message's
    keys whose value is None are dropped and its reasoning is also given as reasoning_content and thinking. A template
    that refuses the conversation (raise_exception, an undefined variable) raises DataError with its message."""
    import jinja2
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        chat.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    try:
        return _compile_chat_template(template).render(messages=chat, tools=None, documents=None,
                                                       add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.TemplateError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"the chat template refuses the conversation: {why}") from None


def apply_chat_template(tok, messages, add_generation_prompt: bool = False) -> str:
    """render_chat_template with the tokenizer's own template and special tokens (its Roles); DataError if it has
    none."""
    roles = roles_of(tok)
    if roles.chat_template is None:
        raise DataError("the tokenizer has no chat template of its own (a Hugging Face folder's)")
    return render_chat_template(roles.chat_template, messages, add_generation_prompt, **roles.chat_tokens)


def encode_chat_text(tok, text: str):
    """The tokenizers Encoding of rendered chat text as transformers' apply_chat_template(tokenize=True) encodes it:
    whole, special-token text matched as those tokens, no post-processor tokens (add_special_tokens=False)."""
    saved, tok.encode_special_tokens = tok.encode_special_tokens, False
    try:
        return tok.encode(text, add_special_tokens=False)
    finally:
        tok.encode_special_tokens = saved


def special_token_texts(tok) -> list[str]:
    """The texts of the tokenizer's special added tokens (its control tokens: <|eot_id|>, </s>, ...), longest first."""
    return sorted({t.content for t in tok.get_added_tokens_decoder().values() if t.special}, key=len, reverse=True)


def chat_stop_ids(tok) -> list[int]:
    """The token ids that end an assistant's answer: eod, and with a chat template of its own the special token the
    template writes right after an assistant's content (Llama 3's <|eot_id|>, ChatML's <|im_end|>) when that is
    another token. tools.py sample --chat stops at them; export writes them as generation_config's eos_token_id."""
    eod = special_ids(tok)["eod"]
    if roles_of(tok).chat_template is None:
        return [eod]
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    head, turn = apply_chat_template(tok, probe[:1], True), apply_chat_template(tok, probe)
    tail = turn[len(head):].split("Hello", 1)[-1]  # what the template writes after the assistant's content
    first = next((t for t in special_token_texts(tok) if tail.startswith(t)), None)
    return [eod] + ([tok.token_to_id(first)] if first is not None and tok.token_to_id(first) != eod else [])


def null_tokenizer(vocab_size: int) -> Tokenizer:
    """NullTokenizer: a document is its token ids written as integers between spaces (Megatron's
    [int(x) for x in text.split(' ')], here split at any whitespace); ids 0 .. vocab_size - 1, and eod = vocab_size,
    written <|endoftext|>. Text that is not such an integer is an error (DataError, from tokenize_documents)."""
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([SPECIAL_TOKENS[0]])  # id vocab_size
    tok.roles = Roles("NullTokenizer")
    return tok


# ------------------------------------------------------------------------------- SentencePiece (.model) tokenizers
SPM_NORMAL, SPM_UNKNOWN, SPM_USER_DEFINED = 1, 2, 4  # sentencepiece_model.proto's piece types (CONTROL 3, BYTE 6, ...)


def sentencepiece_tokenizer(model_file, kind) -> Tokenizer:
    """Llama2Tokenizer / GPTSentencePieceTokenizer: a SentencePiece .model (its protobuf, read with the schema the
    sentencepiece package ships) rebuilt as a `tokenizers.Tokenizer` that gives SentencePiece's own ids: a BPE model's
    merges ranked by the merged piece's score (SentencePiece merges the best-scored pair first), a unigram model's
    pieces and scores (one difference: text spelling a control or byte piece, "</s>" or "<0x41>", is that piece
    here, several in SentencePiece; a BPE model never merges into them); the normalizer's character map, its
    whitespace rules, the dummy prefix "▁" and its split into words ("▁"-runs kept whole when the model allows
    whitespace-only pieces). tests/test_tokenizers.py checks the ids against sentencepiece's encoder. Llama2Tokenizer
    puts the bos token before each document (Megatron's tokenize(bos=True)); both take eod from the eos piece."""
    from sentencepiece import sentencepiece_model_pb2
    _need_file(model_file, "--tokenizer-model", f"{kind}'s SentencePiece .model")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(model_file).read_bytes())
    except Exception as e:  # noqa: BLE001 (protobuf's DecodeError)
        raise DataError(f"--tokenizer-model {model_file} is not a SentencePiece model ({e})") from None
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    odd = [p for p, _, t in pieces if t == SPM_USER_DEFINED]
    if odd or spec.treat_whitespace_as_suffix or not pieces:
        raise DataError(f"--tokenizer-model {model_file}: " + (f"{len(odd)} user-defined pieces ({odd[0]!r}...)"
                        if odd else "whitespace as a suffix" if pieces else "no pieces") + " are not read here")
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == SPM_UNKNOWN), 0)
    if spec.model_type == spec.BPE:
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        ranked = sorted((-score, vocab[p[:k]], vocab[p[k:]], p[:k], p[k:]) for p, score, t in pieces
                        if t == SPM_NORMAL for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab)
        model = models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=pieces[unk][0], fuse_unk=True,
                           byte_fallback=spec.byte_fallback)
    elif spec.model_type == spec.UNIGRAM:
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id=unk, byte_fallback=spec.byte_fallback)
    else:
        raise DataError(f"--tokenizer-model {model_file}: a {spec.ModelType.Name(spec.model_type)} SentencePiece "
                        "model is not read here (BPE and unigram are)")
    tok = Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    steps += [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    if spec.split_by_whitespace:  # a word: "▁"s then the rest (or each "▁" begins one)
        word = "▁*[^▁]+|▁+" if spec.allow_whitespace_only_pieces else "▁[^▁]*|[^▁]+"
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(word), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", int(norm.add_dummy_prefix), 0)])
    bos, eos = (pieces[i][0] if 0 <= i < len(pieces) else None for i in (spec.bos_id, spec.eos_id))
    if eos is None:
        raise DataError(f"--tokenizer-model {model_file} has no eos piece ({kind}'s eod)")
    llama = kind == "Llama2Tokenizer" and bos is not None
    if llama:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, spec.bos_id)])
    pad = pieces[spec.pad_id][0] if 0 <= spec.pad_id < len(pieces) else Roles.pad
    tok.roles = Roles(kind, eod=eos, pad=pad, add_special_tokens=llama)
    return tok


def megatron_tokenizer(args) -> Tokenizer:
    """--tokenizer-type's tokenizer from its local files (the flags TOKENIZER_FILES names), then the SPECIAL_TOKENS
    whose role it has no token for, added after its vocabulary (add_missing_specials)."""
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        tok = byte_level_bpe(args.vocab_file, args.merge_file)
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        tok = wordpiece_tokenizer(args.vocab_file, kind == "BertWordPieceLowerCase",
                                  getattr(args, "vocab_extra_ids", 0) or 0)
    elif kind == "HuggingFaceTokenizer":
        tok = folder_tokenizer(args.tokenizer_model)
    elif kind == "NullTokenizer":
        tok = null_tokenizer(args.vocab_size)
    elif kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = sentencepiece_tokenizer(args.tokenizer_model, kind)
    else:
        raise DataError(f"--tokenizer-type {kind}: {REFUSED_TOKENIZERS.get(kind, 'unknown')}")
    n = tok.get_vocab_size()
    add_missing_specials(tok)
    if tok.get_vocab_size() > n:
        note(f"--tokenizer-type {kind} has no token for {tok.get_vocab_size() - n} of the data layer's roles (pad, cls, "
             f"sep, mask, the span sentinels): added as ids {n}..{tok.get_vocab_size() - 1}")
    return tok
