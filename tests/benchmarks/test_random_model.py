"""benchmarks/random_model.py: a model of a config's shapes that the engine and its tokenizer load."""

import json

from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.serve import engine as engine_lib

from tests.benchmarks import script


def test_a_random_model_of_the_config_shapes_loads_and_generates(tmp_path):
    random_model = script("random_model")
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, hidden_act="silu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = random_model.write(tmp_path / "config.json", tmp_path / "out", dtype="float32")
    target, tokenizer_dir = models.load_target(model_dir)
    assert target.config.vocab_size == 64 and target.config.num_layers == 2
    tokenizer = tokenization.load(tokenizer_dir)
    assert len(tokenizer) == 64 and tokenizer.eos_token_id == 2
    prompt = tokenization.encode_messages(tokenizer, [{"role": "user", "content": "write a poem"}])
    [result] = engine_lib.Engine(target).generate([prompt], max_new_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4 and all(0 <= t < 64 for t in result.token_ids)
