package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"ebb/tinymodel"
)

func tinyModelCmd() *cobra.Command {
	var arch, specJSON string
	var s tinymodel.Spec
	cmd := &cobra.Command{
		Use:   "tiny-model DIR --arch qwen3|qwen3_moe|qwen2|qwen2_moe|llama",
		Short: "Write a small deterministic random-weight model directory",
		Long: `Writes config.json, generation_config.json, model.safetensors and the real
tokenizer files (Qwen3's for qwen3/qwen2, Llama-3's for llama). The weights are
random: the model runs like a real one but its text is gibberish.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := tinymodel.Default(arch)
			if specJSON != "" {
				spec, err = tinymodel.FromJSON([]byte(specJSON))
			}
			if err != nil {
				return err
			}
			// Zero means "the architecture's default" for sizes.
			for _, o := range []struct{ dst, src *int }{
				{&spec.Hidden, &s.Hidden}, {&spec.Intermediate, &s.Intermediate}, {&spec.Layers, &s.Layers},
				{&spec.Heads, &s.Heads}, {&spec.KVHeads, &s.KVHeads}, {&spec.HeadDim, &s.HeadDim},
				{&spec.MaxPositions, &s.MaxPositions},
			} {
				if *o.src > 0 {
					*o.dst = *o.src
				}
			}
			f := cmd.Flags()
			if f.Changed("tie") {
				spec.Tie = s.Tie
			}
			if f.Changed("attention-bias") {
				spec.AttentionBias = s.AttentionBias
			}
			if f.Changed("rope") {
				spec.Rope = s.Rope
				if s.Rope == "none" {
					spec.Rope = ""
				}
			}
			if s.RopeTheta > 0 {
				spec.RopeTheta = s.RopeTheta
			}
			if s.DType != "" {
				spec.DType = s.DType
			}
			if f.Changed("seed") || specJSON == "" {
				spec.Seed = s.Seed
			}
			if err := tinymodel.Write(args[0], spec); err != nil {
				return err
			}
			fmt.Printf("wrote a %s model with random weights to %s (hidden %d, %d layers, %d/%d heads, head_dim %d, tied %v, rope %q)\n",
				spec.Arch, args[0], spec.Hidden, spec.Layers, spec.Heads, spec.KVHeads, spec.HeadDim, spec.Tie, spec.Rope)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&arch, "arch", "qwen3", "qwen3, qwen3_moe, qwen2, qwen2_moe or llama")
	f.IntVar(&s.Hidden, "hidden", 0, "hidden size")
	f.IntVar(&s.Intermediate, "intermediate", 0, "MLP intermediate size")
	f.IntVar(&s.Layers, "layers", 0, "decoder layers")
	f.IntVar(&s.Heads, "heads", 0, "attention heads")
	f.IntVar(&s.KVHeads, "kv-heads", 0, "key/value heads (GQA)")
	f.IntVar(&s.HeadDim, "head-dim", 0, "head dimension")
	f.BoolVar(&s.Tie, "tie", false, "tie lm_head to the embedding")
	f.BoolVar(&s.AttentionBias, "attention-bias", false, "attention biases (qwen3, llama)")
	f.StringVar(&s.Rope, "rope", "", "rope scaling: none, linear or llama3")
	f.Float64Var(&s.RopeTheta, "rope-theta", 0, "rope theta")
	f.IntVar(&s.MaxPositions, "max-positions", 0, "max_position_embeddings")
	f.StringVar(&s.DType, "dtype", "", "BF16 or F32")
	f.Uint64Var(&s.Seed, "seed", 1, "weight seed")
	f.StringVar(&specJSON, "spec", "", `whole spec as JSON, e.g. {"arch":"llama","kv_heads":1} (other flags still override)`)
	return cmd
}
