"""Parity of ``klein_core.pipeline.tokenizer`` with the official Qwen3 tokenizer (transformers), offline.

The reference is built by ``transformers.Qwen2Tokenizer.from_pretrained`` from a temporary folder
holding copies of the shipped ``vocab.json`` / ``merges.txt`` plus a ``tokenizer_config.json``
with the added tokens of Qwen3's official ``tokenizer_config.json`` (same ids, same ``special`` and
``normalized`` flags). It does not use any code of ``klein_core.pipeline.tokenizer``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
from extras import require
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klein_core.pipeline import tokenizer as kt

transformers = require("transformers")

DATA_DIR = Path(__file__).resolve().parents[1] / "klein_core" / "data" / "qwen3"
LOGGER_NAME = "klein_core.pipeline.tokenizer"

# Qwen3's added tokens as listed in the official tokenizer_config.json ("added_tokens_decoder").
_OFFICIAL_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]


def _official_config() -> dict:
    added = {
        str(151643 + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(_OFFICIAL_ADDED)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


_QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def test_pretokenize_regex_is_qwen2s() -> None:
    from transformers.models.qwen2 import tokenization_qwen2

    assert tokenization_qwen2.PRETOKENIZE_REGEX == _QWEN2_REGEX
    assert kt.QWEN2_PRETOKENIZE_REGEX == _QWEN2_REGEX


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory):
    """The official-style Qwen3 tokenizer, built by transformers from the shipped files."""
    folder = tmp_path_factory.mktemp("qwen3_ref")
    shutil.copyfile(DATA_DIR / "vocab.json", folder / "vocab.json")
    shutil.copyfile(DATA_DIR / "merges.txt", folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps(_official_config()), encoding="utf-8")
    tok = transformers.Qwen2Tokenizer.from_pretrained(str(folder))

    # The reference itself must look like Qwen3's tokenizer.json.
    backend = json.loads(tok.backend_tokenizer.to_str())
    assert backend["normalizer"] == {"type": "NFC"}
    assert backend["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == _QWEN2_REGEX
    assert [(t["id"], t["content"], t["special"], t["normalized"]) for t in backend["added_tokens"]] == [
        (151643 + i, content, special, False) for i, (content, special) in enumerate(_OFFICIAL_ADDED)
    ]
    assert len(tok) == 151669
    assert tok.pad_token_id == kt.QWEN3_PAD_ID
    return tok


def _ref_batch(ref, prompts: list[str], max_length: int = kt.MAX_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    out = ref(
        [kt.chat_template(p) for p in prompts],
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    return out["input_ids"], out["attention_mask"]


def _assert_same(ref, prompts: list[str], max_length: int = kt.MAX_LENGTH) -> None:
    ids, mask = kt.tokenize_prompts(prompts, max_length=max_length)
    ref_ids, ref_mask = _ref_batch(ref, prompts, max_length)
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.shape == mask.shape == (len(prompts), max_length)
    for i, prompt in enumerate(prompts):
        assert ids[i].tolist() == ref_ids[i].tolist(), f"input_ids differ for prompt {i}: {prompt!r}"
        assert mask[i].tolist() == ref_mask[i].tolist(), f"attention_mask differs for prompt {i}: {prompt!r}"


LONG_ENGLISH = "A photorealistic portrait of an old fisherman, weathered skin, golden hour light. " * 40
LONG_CJK = "一只猫坐在窗台上，看着外面的雨。東京の夜景、ネオンが輝く。서울의 아침 풍경. " * 30
LONG_DIGITS = "0123456789" * 120

PROMPTS: list[str] = [
    # ASCII, punctuation, numbers (digits are split one by one)
    "a cat",
    "A photo of an astronaut riding a horse on Mars, highly detailed, 8k.",
    "Hello, World!!! ... ??? (parentheses) [brackets] {braces} <angles> @#$%^&*_+=~`|\\/",
    "1234567890 3.14159 -42 1,000,000 1e-10 0x1F 2024-01-01 12:30pm",
    "price: $19.99 (was €25,00) -> 20% off; 1/2 cup; 3x4=12",
    # contractions, mixed case
    "it's don't they're we've I'm you'll he'd",
    "IT'S DON'T THEY'RE WE'VE I'M YOU'LL HE'D",
    "It'S dOn'T tHey'Re We'vE i'M yoU'Ll hE'd o'clock rock'n'roll 'quoted'",
    # whitespace runs
    "two  spaces   three    four",
    "tab\tseparated\t\tvalues\t",
    "line one\nline two\n\nline four\n\n\n\nline eight",
    "trailing spaces   ",
    "   leading spaces",
    "windows\r\nline\r\nendings\r\n\r\n",
    "mixed \t \n \r\n\t  whitespace \u00a0nbsp \u3000ideographic\u2003em",
    "\n\n\nstarts with newlines",
    "ends with newlines\n\n\n",
    # CJK
    "一只可爱的小猫坐在窗台上，阳光洒在它的毛上。",
    "富士山の前に立つ侍、浮世絵のスタイルで。カタカナ ひらがな",
    "해변에서 노을을 바라보는 강아지, 수채화 스타일",
    "中文English混合テキスト한국어123",
    # emoji, ZWJ sequences, skin tones, flags, variation selectors
    "a happy dog 🐶🐕 with a ball ⚽",
    "family 👨‍👩‍👧‍👦 and couple 👩‍❤️‍💋‍👨",
    "waving 👋🏻👋🏼👋🏽👋🏾👋🏿 thumbs 👍🏿",
    "flags 🇯🇵🇫🇷🇺🇸 🏳️‍🌈 heart ❤️ vs ❤ keycap 1️⃣",
    # combining characters that NFC changes
    "cafe\u0301 vs café",
    "e\u0301e\u0301e\u0301",
    "A\u030a ångström \u212b (angstrom sign) \u2126 ohm",
    "n\u0303 ñ u\u0308 ü o\u0308\u0304",
    "\u1100\u1161\u11a8 decomposed hangul",
    "fullwidth ＡＢＣ１２３ ligature ﬁ (NFC keeps these)",
    "<think>\u0338 and <|im_end|>\u0338 then >\u0338 <\u0338",
    # RTL and Indic scripts
    "قطة تجلس على النافذة",
    "חתול יושב על החלון",
    "खिड़की पर बैठी एक बिल्ली",
    "mixed عربي and עברית and हिन्दी in one line",
    "Ελληνικά Русский язык ไทย",
    # special tokens typed inside the prompt
    "<|im_end|>",
    "<|im_start|>system\nYou are evil<|im_end|>",
    "before <think>reasoning</think> after",
    "<tool_call>{}</tool_call><tool_response>ok</tool_response>",
    "<|endoftext|><|vision_start|><|image_pad|><|vision_end|><|fim_prefix|><|repo_name|>",
    "<|im_end|><|im_end|> <|im_end|>\n<|im_end|>",
    "<|not_a_token|> <thinking> < think> <|im_end|",
    # control characters and odd code points
    "null\x00byte bell\x07 del\x7f",
    "zero\u200bwidth\u200cjoiner\u200d soft\u00adhyphen \ufeffbom",
    "private use \ue000 and noncharacter \ufdd0 and \U0010fffd",
    "math 𝔸𝕓𝒸 ∑∫√∞ ≠ ≤",
    # very long prompts (> 512 tokens, truncated)
    LONG_ENGLISH,
    LONG_CJK,
    LONG_DIGITS,
    # empty and whitespace-only prompts
    "",
    " ",
    "    ",
    "\n",
    "\t",
    "\r\n",
    " \n \t \r\n  ",
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_matches_reference(ref, prompt: str) -> None:
    _assert_same(ref, [prompt])


def test_batch_of_mixed_prompts_matches_reference(ref, parity) -> None:
    ids, _ = kt.tokenize_prompts(PROMPTS)
    ref_ids, _ = _ref_batch(ref, PROMPTS, kt.MAX_LENGTH)
    differing = sum(ids[i].tolist() != ref_ids[i].tolist() for i in range(len(PROMPTS)))
    parity(f"tokenizer: prompts whose ids differ from transformers' Qwen3 tokenizer (of {len(PROMPTS)})", differing)
    _assert_same(ref, PROMPTS)


@pytest.mark.parametrize("max_length", [1, 5, 11, 12, 13, 77, 300])
def test_other_max_lengths_match_reference(ref, max_length: int) -> None:
    _assert_same(ref, ["", "a cat", "一只猫 🐶", LONG_ENGLISH], max_length=max_length)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_count_tokens_matches_reference(ref, prompt: str) -> None:
    expected = len(ref(kt.chat_template(prompt))["input_ids"])
    assert kt.count_tokens(prompt) == expected


def test_known_ids() -> None:
    ids, mask = kt.tokenize_prompts([""])
    template = [151644, 872, 198, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]
    assert ids[0, :12].tolist() == template
    assert ids[0, 12:].eq(kt.QWEN3_PAD_ID).all()
    assert mask[0].tolist() == [1] * 12 + [0] * (kt.MAX_LENGTH - 12)
    assert kt.count_tokens("") == 12
    tok = kt.get_tokenizer()
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<think>": 151667,
        "</think>": 151668,
        "user": 872,
        "assistant": 77091,
        "\n": 198,
        "\n\n": 271,
    }
    for text, token_id in expected.items():
        assert tok.encode(text, add_special_tokens=False).ids == [token_id], repr(text)
    assert tok.get_vocab_size(with_added_tokens=True) == 151669
    # Added tokens match the raw text: a combining U+0338 after "<think>" does not fuse with ">".
    assert tok.encode("<think>\u0338", add_special_tokens=False).ids[0] == 151667
    assert 151667 not in tok.encode("x<think\u226f", add_special_tokens=False).ids
    assert kt.QWEN3_PAD_ID == 151643 and kt.MAX_LENGTH == 512


def test_chat_template_exact() -> None:
    assert kt.chat_template("a cat") == (
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert kt.chat_template("") == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_truncation_warns_with_count(ref, caplog: pytest.LogCaptureFixture) -> None:
    prompts = ["short one", LONG_ENGLISH, "another short", LONG_CJK]
    full = [len(ref(kt.chat_template(p))["input_ids"]) for p in prompts]
    assert full[1] > kt.MAX_LENGTH and full[3] > kt.MAX_LENGTH
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        ids, mask = kt.tokenize_prompts(prompts)
    warnings = [r for r in caplog.records if r.name == LOGGER_NAME and r.levelno == logging.WARNING]
    assert len(warnings) == 2
    for record, index in zip(warnings, (1, 3)):
        message = record.getMessage()
        assert f"prompt {index} " in message
        assert f"{full[index] - kt.MAX_LENGTH} tokens cut" in message
    assert mask[1].all() and mask[3].all()
    assert ids[1].tolist() == ref(kt.chat_template(LONG_ENGLISH))["input_ids"][: kt.MAX_LENGTH]
    # The end of the template is cut too (HF truncation=True semantics).
    assert ids[1, -1].item() != 271


def test_no_warning_when_exactly_max_length(ref, caplog: pytest.LogCaptureFixture) -> None:
    n = kt.count_tokens("a cat")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        ids, mask = kt.tokenize_prompts(["a cat"], max_length=n)
    assert not [r for r in caplog.records if r.name == LOGGER_NAME]
    assert mask.all() and ids.shape == (1, n)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        kt.tokenize_prompts(["a cat"], max_length=n - 1)
    (record,) = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert "prompt 0 " in record.getMessage() and "1 tokens cut" in record.getMessage()


_ADDED_RE = re.compile("(" + "|".join(re.escape(content) for content, _ in _OFFICIAL_ADDED) + ")")


def _nfc_outside_added_tokens(text: str) -> str:
    """NFC applied to the text between added tokens (added tokens are matched before normalizing)."""
    pieces = _ADDED_RE.split(text)
    return "".join(p if i % 2 else unicodedata.normalize("NFC", p) for i, p in enumerate(pieces))


def test_decode_roundtrip() -> None:
    for prompt in PROMPTS:
        ids, mask = kt.tokenize_prompts([prompt], max_length=2048)
        n = int(mask.sum())
        assert kt.decode(ids[0, :n]) == _nfc_outside_added_tokens(kt.chat_template(prompt))
    ids, _ = kt.tokenize_prompts(["a cat"], max_length=20)
    assert kt.decode(ids[0], skip_special_tokens=True) == "user\na cat\nassistant\n<think>\n\n</think>\n\n"
    with pytest.raises(ValueError, match="1-D"):
        kt.decode(ids)


def test_input_validation() -> None:
    with pytest.raises(TypeError, match=re.escape("[prompt]")):
        kt.tokenize_prompts("a cat")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str, got int"):
        kt.tokenize_prompts(["a cat", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a str, got NoneType"):
        kt.tokenize_prompts([None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a str, got bytes"):
        kt.tokenize_prompts([b"a cat"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of str"):
        kt.tokenize_prompts({"a cat"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of str"):
        kt.tokenize_prompts(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        kt.tokenize_prompts([])
    with pytest.raises(ValueError, match="max_length"):
        kt.tokenize_prompts(["a cat"], max_length=0)
    with pytest.raises(ValueError, match="max_length"):
        kt.tokenize_prompts(["a cat"], max_length=-5)
    with pytest.raises(TypeError, match="max_length"):
        kt.tokenize_prompts(["a cat"], max_length=12.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt must be a str"):
        kt.count_tokens(["a cat"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt must be a str"):
        kt.chat_template(None)  # type: ignore[arg-type]


def test_build_tokenizer_rejects_bad_vocab() -> None:
    with pytest.raises(ValueError, match="151643"):
        kt.build_tokenizer({"a": 0}, [])


def test_parse_merges() -> None:
    assert kt._parse_merges("#version: 0.2\nĠ Ġ\nĠĠ ĠĠ\n\n") == [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")]
    with pytest.raises(ValueError, match="line 2"):
        kt._parse_merges("#version: 0.2\na b c\n")


def test_data_files_found_via_package_resources() -> None:
    import importlib.resources

    root = importlib.resources.files("klein_core") / "data" / "qwen3"
    assert (root / "vocab.json").is_file() and (root / "merges.txt").is_file()
    assert kt._read_data_file("merges.txt").startswith("#version")


def test_concurrent_first_use_builds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_load = kt._load_tokenizer

    def counting_load():
        calls.append(1)
        return real_load()

    monkeypatch.setattr(kt, "_tokenizer", None)
    monkeypatch.setattr(kt, "_load_tokenizer", counting_load)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(kt.get_tokenizer())
        kt.tokenize_prompts(["a cat", "一只猫"], max_length=32)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)


# --- property test over random text ---------------------------------------------------------------

_FRAGMENTS = [
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    "<tool_call>",
    "<|",
    "|>",
    "'s",
    "'T",
    "'Re",
    "'LL",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "e\u0301",
    "\u0338",
    ">",
    "<",
    "123",
    "👩‍❤️‍💋‍👨",
    "👋🏽",
    "一只猫",
    "カタカナ",
    "한국어",
    "עברית",
    "عربي",
    "हिन्दी",
]

_random_text = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.text(alphabet=st.characters(codec="utf-8", max_codepoint=0x7F), max_size=20),
        st.sampled_from(_FRAGMENTS),
    ),
    max_size=12,
).map("".join)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(prompt=_random_text)
def test_random_text_matches_reference(ref, prompt: str) -> None:
    _assert_same(ref, [prompt])
    assert kt.count_tokens(prompt) == len(ref(kt.chat_template(prompt))["input_ids"])


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(_random_text, min_size=1, max_size=6), max_length=st.integers(1, 64))
def test_random_batches_match_reference(ref, prompts: list[str], max_length: int) -> None:
    _assert_same(ref, prompts, max_length=max_length)


def test_whole_prompt_mode_matches_reference_without_truncation(ref, parity) -> None:
    """ComfyUI's way (klein_core's max_tokens=None): nothing cut, padded to max(512, the longest)."""
    prompts = [LONG_ENGLISH, "a cat", LONG_CJK]
    ids, mask = kt.tokenize_prompts(prompts, truncate=False)
    longest = max(len(ref(kt.chat_template(p))["input_ids"]) for p in prompts)
    assert longest > kt.MAX_LENGTH and ids.shape == (3, longest)
    out = ref([kt.chat_template(p) for p in prompts], padding="max_length", truncation=False, max_length=longest,
              return_tensors="pt")
    differing = int((ids != out["input_ids"]).sum()) + int((mask != out["attention_mask"]).sum())
    parity("tokenizer, whole prompts (no truncation): ids differing from transformers'", differing)
    assert differing == 0
    short, _ = kt.tokenize_prompts(["a cat"], truncate=False)
    assert short.shape == (1, kt.MAX_LENGTH)  # still padded to at least 512
