"""adahop with Hugging Face ``transformers`` models.

``adahop.convert_model`` works on a ``transformers`` model as on any ``nn.Module`` (the LM head,
``lm_head``, stays ``nn.Linear``). ``AdaHOPLinear`` keeps ``nn.Linear``'s parameter keys and adds
one ``_extra_state`` tensor per layer; a plain ``save_pretrained`` keeps it and plain
``transformers`` loads such weights, reporting those keys as unexpected. :func:`save_pretrained`
writes clean weights instead, with the frozen plan beside them in ``adahop_plan.json``, and
:func:`from_pretrained` converts and freezes a model from such a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..nn.convert import adahop_layers, convert_model, model_plan
from ..policy.calibration import ModelPlan
from ..recipes import DEFAULT_RECIPE, Recipe

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PLAN_FILE = "adahop_plan.json"
_EXTRA_STATE = "._extra_state"


def save_pretrained(model: PreTrainedModel, path: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(path)`` with exactly the unconverted model's keys, plus the
    frozen plan in ``path/adahop_plan.json``. While any layer is still calibrating there is no
    complete plan: none is written (an older one is removed) and the loaded model calibrates again."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA_STATE)}
    model.save_pretrained(path, state_dict=state, **kwargs)
    plan_file = Path(path) / PLAN_FILE
    if any(layer.calibrating for layer in adahop_layers(model).values()):
        plan_file.unlink(missing_ok=True)
    else:
        model_plan(model).save(plan_file)


def from_pretrained(
    model_cls: type, path: str | Path, recipe: str | Recipe | dict = DEFAULT_RECIPE, **kwargs: Any
) -> PreTrainedModel:
    """``model_cls.from_pretrained(path)`` converted with ``recipe``, frozen from
    ``path/adahop_plan.json`` when the folder has one (otherwise it calibrates)."""
    model = model_cls.from_pretrained(path, **kwargs)
    plan_file = Path(path) / PLAN_FILE
    plan = ModelPlan.load(plan_file) if plan_file.exists() else None
    return convert_model(model, recipe, plan=plan)
