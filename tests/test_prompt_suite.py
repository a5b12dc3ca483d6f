"""The packaged prompt suite (data/prompts/suite.json)."""

import json
from collections import Counter

from stratatools.core.resources import packaged
from stratatools.runtime.run import read_prompts
from stratatools.runtime.tokenizer import BPETokenizer
from stratatools.synth.model import build_tokenizer


def test_suite_is_packaged_and_readable():
    path = packaged("data", "prompts", "suite.json")
    prompts = read_prompts(path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    doms = Counter(p["domain"] for p in doc["prompts"])
    assert len(prompts) == len(doc["prompts"]) >= 40
    assert set(doms) == set(doc["domains"]) and len(doms) >= 4 and min(doms.values()) >= 8
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    t = build_tokenizer(512)
    tok = BPETokenizer(list(t.tokens), list(t.merges), list(t.token_types))
    lens = [len(tok.encode(p.text)) for p in prompts]
    assert min(lens) >= 30 and sum(lens) >= 2500
