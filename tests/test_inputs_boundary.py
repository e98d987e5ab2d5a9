"""Two boundaries a mutant slipped past: a mixture-of-experts checkpoint lacking one expert's tensors is refused from
the headers, before any weight is loaded, naming the stored tensors it lacks (on the streamed and the whole path, for
every tiny MoE family stored one tensor per expert); and the vocabulary's last id is taken while the id equal to its
size is refused, deterministically (a `>` for `>=` in the id check fails here, not only when a property test happens
to draw the boundary)."""

from __future__ import annotations

import string

import pytest
import test_inputs_complete
from hostile import SHORT, folder_hash, refused
from safetensors.torch import load_file, save_file
from test_inputs_complete import save_offset_tokenizer

from halfsafe.calibration import make_samples
from halfsafe.errors import HalfsafeError

pytestmark = pytest.mark.usefixtures("one_thread")
slow_part, weights_loaded = test_inputs_complete.slow_part, test_inputs_complete.weights_loaded  # its fixtures, here too


# ----- a mixture of experts lacking one expert's tensors -------------------------------------------------------------

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]  # tiny MoE checkpoints stored one tensor per expert


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole"])
@pytest.mark.parametrize("drop", ["one-tensor", "whole-expert"])
@pytest.mark.parametrize("key", MOE)
def test_an_moe_checkpoint_lacking_an_expert_is_refused_naming_the_tensor(tmp_path, capsys, slow_part, weights_loaded, key,
                                                                          drop, whole):
    """transformers merges the per-expert tensors into one weight on load; one expert's missing is refused from the
    headers, before any weight is loaded, naming the stored tensor(s) the checkpoint lacks (not the merged name)."""
    from tiny import save_tiny

    folder = save_tiny(key, tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    expert = sorted(k for k in tensors if ".experts.1." in k)
    assert expert, f"tiny {key} stores no per-expert tensors"
    gone = expert[:1] if drop == "one-tensor" else [k for k in expert if k.startswith(expert[0].split(".experts.1.")[0])]
    save_file({k: v for k, v in tensors.items() if k not in gone}, folder / "model.safetensors", metadata={"format": "pt"})
    before, out = folder_hash(folder), tmp_path / "out"
    more = f"(and {len(gone) - 1} more)" if len(gone) > 1 else "a weight the model needs"
    err = refused(capsys, ["convert", str(folder), str(out), *SHORT, *(["--whole"] if whole else [])], "lacks", more)
    assert any(f"lacks {g} " in err or f"lacks {g}," in err for g in gone), err
    assert not out.exists() and folder_hash(folder) == before and not slow_part and not weights_loaded


# ----- the vocabulary's boundary -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["bos", "text"])
def test_the_last_id_of_the_vocabulary_is_taken_and_the_next_refused(tmp_path, where):
    """Deterministic at the boundary: ids 0 .. vocab - 1 are the embedding's, id vocab is not (as BOS, or as a character
    of the text), on the path every command cuts its samples by (make_samples; verify's prepare_inputs too)."""
    from transformers import AutoTokenizer

    from halfsafe.verify.runner import prepare_inputs

    vocab, text = 300, "a"
    for top, ok in ((vocab - 1, True), (vocab, False)):
        folder = tmp_path / f"{where}-{top}"
        if where == "bos":
            save_offset_tokenizer(folder, 400, 1, bos=top)
        else:  # "a" is the character with id `top`: printable characters from `offset` on, "a" the 11th of them
            chars = [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]
            save_offset_tokenizer(folder, 400, top - chars.index("a") - 1, bos=None)
        tok = AutoTokenizer.from_pretrained(folder)
        assert top in (tok(text)["input_ids"] if where == "text" else [tok.bos_token_id])
        if ok:
            assert int(make_samples([text * 40], tok, vocab, 32)[0].max()) == top
            assert prepare_inputs([text * 40], ["t"], tok, vocab, 32, 1, 0)
        else:
            with pytest.raises(HalfsafeError, match=f"id {top} .*holds {vocab} tokens \\(ids 0 .. {vocab - 1}\\)"):
                make_samples([text * 40], tok, vocab, 32)
            with pytest.raises(HalfsafeError, match=f"id {top}"):
                prepare_inputs([text * 40], ["t"], tok, vocab, 32, 1, 0)
