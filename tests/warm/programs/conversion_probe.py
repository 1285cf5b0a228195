"""Records whether transformers' checkpoint conversion mapping (built lazily by its first
``save_pretrained``) already exists when the program starts, and what its first lookup
costs.  Never imports stalwart and has no ``__main__`` guard, as many scripts."""

import json
import os
import sys
import time

import transformers.conversion_mapping as cm

built = cm._checkpoint_conversion_mapping_cache is not None
t0 = time.perf_counter()
cm.get_checkpoint_conversion_mapping("gpt2")
first_s = time.perf_counter() - t0
name = os.path.join(sys.argv[1], f"probe_{os.environ['RANK']}.json")
with open(name + ".tmp", "w") as fh:
    entries = len(cm._checkpoint_conversion_mapping_cache or ())
    json.dump({"built": built, "first_s": first_s, "entries": entries}, fh)
os.rename(name + ".tmp", name)
