"""Continued pre-training of a Hugging Face Llama with unbroken, nothing downloaded: start from a directory of
weights on disk, train 2 replicas with validation loss and torch.compile (a replica killed on the way),
export the last step, and load the result with transformers.
Usage: python examples/hf_continue.py [WORK_DIR]   (default runs/hf-continue)"""
import json, subprocess, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

work = Path((sys.argv + ["runs/hf-continue"])[1])
unbroken = [sys.executable, "-m", "unbroken.cli"]
# 1. The weights you start from: here a small LlamaForCausalLM that transformers saves (yours: any such dir).
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5)).save_pretrained(work / "hf-in")
# 2. Train from them: [model] describes the same Llama; validation loss every 2 steps on the last 5% of the
#    data (never trained on), each block compiled, replica 1 killed in step 3, a checkpoint of the last step.
model = ["--model.arch=llama", "--model.n_embd=64", "--model.n_layer=2", "--model.n_head=4", "--model.n_kv_head=2",
         "--model.intermediate_size=128", "--model.block_size=64", f"--model.init_from={work / 'hf-in'}"]
subprocess.run([*unbroken, "train", "--replicas", "2", "--steps", "8", "--microbatches", "4", "--exact", *model,
                "--eval.every=2", "--eval.split=0.05", "--eval.microbatches=4", "--model.compile=true",
                "--model.compile_backend=aot_eager", "--faults", "kill:replica=1,step=3,phase=compute",
                "--checkpoint.every=100", "--launch.progress=false", "--out", str(work / "run")], check=True)
# 3. Export the last step as a Hugging Face directory and load it with transformers.
subprocess.run([*unbroken, "export", str(work / "run"), "--hf", str(work / "hf-out")], check=True)
tuned = AutoModelForCausalLM.from_pretrained(work / "hf-out")
start = AutoModelForCausalLM.from_pretrained(work / "hf-in")
text = torch.tensor([list(b"def main():\n    return 0\n" * 2)])
with torch.no_grad():
    before, after = (m(text, labels=text).loss.item() for m in (start, tuned))
evals = [json.loads(line) for line in open(work / "run" / "events.jsonl") if '"event":"eval"' in line]
print("validation loss by step:", {e["step"]: round(e["loss"], 4) for e in evals})
print(f"loaded {type(tuned).__name__}: loss on a line of Python {before:.3f} before, {after:.3f} after")
