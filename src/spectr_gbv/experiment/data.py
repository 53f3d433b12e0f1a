"""Prompts: the five real datasets (files shipped inside pip packages, read offline), a hub id for users with network,
or a few inline texts; and the Lightning data module that shards them over ranks without duplicates."""
from collections.abc import Mapping
from pathlib import Path

import datasets
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader

from spectr_gbv.decoding.gguf_packages import package_folder
from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.config import Knobs


def load_prompts(name: str, template: str, texts: list[str] | None = None, package: str | None = None,
                 file: str | None = None, hub_id: str | None = None, hub_config: str | None = None,
                 split: str = "train", limit: int | None = None) -> list[str]:
    """The first `limit` prompts of a dataset, each row formatted with `template` (e.g. "{question}").

    Source: `texts` if given, else `hub_id` (needs network), else `file` inside the installed pip `package`."""
    if texts is not None:
        rows = datasets.Dataset.from_dict({"text": list(texts)})
    elif hub_id is not None:
        rows = datasets.load_dataset(hub_id, hub_config, split=split)
    else:
        rows = datasets.load_dataset("json", data_files=str(packaged_file(name, package, file)), split="train")
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    try:
        prompts = [template.format(**row) for row in rows]
    except (KeyError, IndexError) as error:
        raise ConfigError(f"dataset.{name}.template", repr(template),
                          f"fields must be columns of the data: {', '.join(rows.column_names)}") from error
    for index, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ConfigError("dataset", name, f"prompt {index} is empty; every prompt needs text")
    if not prompts:
        raise ConfigError("dataset", name, "has no prompts")
    return prompts


def packaged_file(name: str, package: str, file: str) -> Path:
    """A data file inside an installed package (its dependencies are deliberately not installed)."""
    folder = package_folder(package)
    if folder is None:
        raise ConfigError("dataset", name, f"needs the pip package providing `{package}`; run `make install`")
    path = folder / file
    if not path.is_file():
        raise ConfigError("dataset", name, f"file {path} is missing; reinstall the package providing `{package}`")
    return path


class PromptDataModule(LightningDataModule):
    """Every configured dataset's prompts, one record per prompt; each rank gets every world_size-th record.

    Lightning's own distributed sampler pads the last batch with duplicates during test; with
    `use_distributed_sampler: false` in the trainer config we shard with Lightning's UnrepeatedDistributedSampler
    (the one its predict loop uses), so each prompt is decoded exactly once and ranks differ by at most one step.
    """

    def __init__(self, datasets: Mapping, knobs: Knobs):
        """datasets: name -> a node that instantiates to its prompts (conf/dataset/); of the knobs, limit and
        batch_size."""
        super().__init__()
        self.save_hyperparameters(logger=False)  # the datasets are part of the job (SpeculativeEvaluation.job)
        self.dataset_configs = datasets
        self.limit, self.batch_size = knobs.limit, knobs.batch_size
        self.names = list(datasets)
        self.records: list[dict] = []

    def setup(self, stage: str) -> None:
        self.records = [
            {"dataset": name, "prompt_id": index, "prompt": prompt}
            for name, config in self.dataset_configs.items()
            for index, prompt in enumerate(instantiate(config, name=name, limit=self.limit))
        ]

    def test_dataloader(self) -> DataLoader:
        sampler = UnrepeatedDistributedSampler(self.records, num_replicas=self.trainer.world_size,
                                               rank=self.trainer.global_rank, shuffle=False)
        # a batch is a list of prompt records, decoded together by the engine
        return DataLoader(self.records, batch_size=self.batch_size, sampler=sampler, collate_fn=list)
