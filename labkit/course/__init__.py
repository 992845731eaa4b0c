"""The course map: one entry per lab, in the outline's order.

The README's table, ``labkit run`` and the report all read this list, so a lab's
name, question, module and speaker are written down once. This package holds the
course machinery, apart from the lab topics in ``labkit/``: the ``labkit`` command
(:mod:`.cli`), running a lab in a fresh kernel (:mod:`.runner`), the figures a
notebook records for the report (:mod:`.results`), merged workshop reports
(:mod:`.classroom`), and the machine checks (:mod:`.doctor`, :mod:`.machinecard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lab:
    number: int
    slug: str
    question: str
    modules: tuple[str, ...]
    speaker: str

    @property
    def notebook(self) -> str:
        return f"{self.number:02d}_{self.slug}.ipynb"


LABS = (
    Lab(1, "input_pipeline", "Can the model keep the accelerator busy, or is the input path starving it?",
        ("loaders", "ladder", "accelerator", "meter", "dataset", "objectstore", "remote_model"), "Kashish Mittal (Uber)"),
    Lab(2, "data_engine", "How should the dataset be represented and loaded by a data engine?",
        ("catalog", "dataengine", "objectstore"), "Jay Chia (Eventual / Daft)"),
    Lab(3, "memory_movement", "Is each operation limited by arithmetic or by memory movement?",
        ("roofline", "microbench", "overlap", "fusion"), "Chris Fregly"),
    Lab(4, "zero_memory", "Where does training memory go, and what do ZeRO and offload cost?",
        ("zero", "zero_probe"), "Olatunji Ruwase (DeepSpeed)"),
    Lab(5, "gradient_sync", "When do more devices make training slower, and how does accumulation fix it?",
        ("collectives", "gradsync", "parallelism", "fabric"), "Samyam Rajbhandari"),
    Lab(6, "quantized_collectives", "What do quantized collectives (ZeRO++) trade for bandwidth?",
        ("quantcomm", "zeropp", "zeropp_fabric", "zeropp_deepspeed"), "Guanhua Wang (ZeRO++)"),
    Lab(7, "checkpoints_and_fusion", "Do checkpoints stop the world, and do kernels waste memory?",
        ("checkpoint", "interval", "fused_loss"), "Animesh Singh (LinkedIn)"),
    Lab(8, "recovery_and_placement", "Does the run finish: recovery from failures and cluster placement?",
        ("recovery", "triage", "placement", "placement_probe"), "Sahil Khanna (Adobe)"),
)


def notebooks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "notebooks"


def select(names: list[str]) -> list[Lab]:
    """Labs by number (``3``), padded number (``03``), slug, or ``all``."""
    if not names or names == ["all"]:
        return list(LABS)
    chosen = []
    for name in names:
        match = [lab for lab in LABS if name in (str(lab.number), f"{lab.number:02d}", lab.slug)]
        if not match:
            valid = ", ".join(f"{lab.number} ({lab.slug})" for lab in LABS)
            raise ValueError(f"unknown lab {name!r}; choose from: all, {valid}")
        chosen.extend(match)
    return chosen
