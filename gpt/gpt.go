// Package gpt describes the GPT-2 model that dos trains, once for every
// trainer (the CPU reference in package trainer and the GPU one): its
// configuration (Hugging Face's GPT2Config fields), the parameter tensors
// with their names, shapes and order, their count, the FLOPs per token that
// MFU divides by, and the four GPT-2 sizes as presets.
//
// It imports no package of this module.
//
// References:
//   - Radford et al. Language Models are Unsupervised Multitask Learners (GPT-2), 2019.
//   - Hugging Face transformers, models/gpt2/configuration_gpt2.py (GPT2Config)
//     and modeling_gpt2.py (the parameter names and shapes).
//   - Karpathy, llm.c: train_gpt2.c and train_gpt2.cu (the padded vocabulary,
//     the parameter count, gpt2_estimate_mfu).
package gpt

import (
	"fmt"
	"strings"
)

// Config is a GPT-2 configuration. The JSON names are those of Hugging Face's
// GPT2Config (config.json), so a Config marshals into the fields a
// GPT2LMHeadModel export needs; the other GPT2Config fields keep their defaults
// there (layer_norm_epsilon 1e-5, activation_function "gelu_new", no dropout
// in eval mode, tied embeddings).
type Config struct {
	VocabSize int `json:"vocab_size"`  // V: rows of wte, columns of the logits
	NCtx      int `json:"n_positions"` // maximum sequence length: rows of wpe
	NLayer    int `json:"n_layer"`     // L: transformer blocks
	NHead     int `json:"n_head"`      // attention heads; NEmbd/NHead is the head size
	NEmbd     int `json:"n_embd"`      // C: width of the residual stream
}

// Upper bounds Validate enforces. They keep every activation and parameter
// count well inside int, and token ids inside int32.
const (
	MaxVocabSize = 1 << 24 // most rows of wte
	MaxNCtx      = 1 << 20 // longest sequence, in tokens
	MaxNLayer    = 1 << 10 // most transformer blocks
	MaxNEmbd     = 1 << 16 // widest residual stream, in elements
)

// Validate reports the first field out of range, named as in config.json
// (it also checks the configs of checkpoints): every field must be at least
// 1 and at most its Max constant (NHead at most NEmbd), and NEmbd must be a
// multiple of NHead.
func (c Config) Validate() error {
	check := func(name string, v, hi int) error {
		if v < 1 || v > hi {
			return fmt.Errorf("gpt: %s = %d, want 1..%d", name, v, hi)
		}
		return nil
	}
	if err := check("vocab_size", c.VocabSize, MaxVocabSize); err != nil {
		return err
	}
	if err := check("n_positions", c.NCtx, MaxNCtx); err != nil {
		return err
	}
	if err := check("n_layer", c.NLayer, MaxNLayer); err != nil {
		return err
	}
	if err := check("n_embd", c.NEmbd, MaxNEmbd); err != nil {
		return err
	}
	if err := check("n_head", c.NHead, c.NEmbd); err != nil {
		return err
	}
	if c.NEmbd%c.NHead != 0 {
		return fmt.Errorf("gpt: n_embd = %d is not a multiple of n_head = %d", c.NEmbd, c.NHead)
	}
	return nil
}

// Indices into Tensors() of the tensors before the blocks.
const (
	Wte = 0 // wte.weight [V, C]: the token embedding, tied to the LM head
	Wpe = 1 // wpe.weight [NCtx, C]: the position embedding
)

// Offsets of a block's tensors from LayerBase(l), in Tensors() order; C is
// NEmbd. Linear weights are [in, out] (HF's Conv1D).
const (
	Ln1W      = 0  // h.l.ln_1.weight [C]
	Ln1B      = 1  // h.l.ln_1.bias [C]
	AttnW     = 2  // h.l.attn.c_attn.weight [C, 3C]: q, k, v in column blocks
	AttnB     = 3  // h.l.attn.c_attn.bias [3C]
	AttnProjW = 4  // h.l.attn.c_proj.weight [C, C]
	AttnProjB = 5  // h.l.attn.c_proj.bias [C]
	Ln2W      = 6  // h.l.ln_2.weight [C]
	Ln2B      = 7  // h.l.ln_2.bias [C]
	FcW       = 8  // h.l.mlp.c_fc.weight [C, 4C]
	FcB       = 9  // h.l.mlp.c_fc.bias [4C]
	FcProjW   = 10 // h.l.mlp.c_proj.weight [4C, C]
	FcProjB   = 11 // h.l.mlp.c_proj.bias [C]
	PerLayer  = 12 // tensors per block
)

// Offsets of the final LayerNorm's tensors from LayerBase(NLayer): they
// follow the last block and end Tensors().
const (
	LnfW = 0 // ln_f.weight [C]
	LnfB = 1 // ln_f.bias [C]
)

// LayerBase returns the index in Tensors() of block l's first tensor
// (h.l.ln_1.weight): 2 + PerLayer*l. LayerBase(NLayer) is ln_f.weight's.
func LayerBase(l int) int { return 2 + PerLayer*l }

// Tensor is one parameter tensor: its Hugging Face GPT-2 name (GPT2Model's
// state_dict key without the "transformer." prefix) and its row-major shape
// in elements.
type Tensor struct {
	Name  string
	Shape []int
}

// Numel returns the tensor's element count, the product of its shape.
func (t Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// NumTensors returns len(Tensors()): 2 + PerLayer*NLayer + 2.
func (c Config) NumTensors() int { return LayerBase(c.NLayer) + 2 }

// Tensors returns the model's parameter tensors, in this order:
//
//	wte.weight [V, C], wpe.weight [NCtx, C],
//	for each layer l in 0..NLayer-1:
//	  h.l.ln_1.weight [C], h.l.ln_1.bias [C],
//	  h.l.attn.c_attn.weight [C, 3C], h.l.attn.c_attn.bias [3C],
//	  h.l.attn.c_proj.weight [C, C], h.l.attn.c_proj.bias [C],
//	  h.l.ln_2.weight [C], h.l.ln_2.bias [C],
//	  h.l.mlp.c_fc.weight [C, 4C], h.l.mlp.c_fc.bias [4C],
//	  h.l.mlp.c_proj.weight [4C, C], h.l.mlp.c_proj.bias [C],
//	ln_f.weight [C], ln_f.bias [C].
//
// Linear weights are stored [in, out] as HF's Conv1D (y = x @ W + b). The LM
// head is tied to wte (logits = x @ wteᵀ), so there is no lm_head tensor.
// The constants Wte, Wpe, LayerBase(l)+Ln1W, ... and LayerBase(NLayer)+LnfW
// index this slice. Tensors does not validate c.
func (c Config) Tensors() []Tensor {
	C := c.NEmbd
	ts := make([]Tensor, 0, c.NumTensors())
	ts = append(ts,
		Tensor{"wte.weight", []int{c.VocabSize, C}},
		Tensor{"wpe.weight", []int{c.NCtx, C}})
	for l := 0; l < c.NLayer; l++ {
		p := fmt.Sprintf("h.%d.", l)
		ts = append(ts,
			Tensor{p + "ln_1.weight", []int{C}},
			Tensor{p + "ln_1.bias", []int{C}},
			Tensor{p + "attn.c_attn.weight", []int{C, 3 * C}},
			Tensor{p + "attn.c_attn.bias", []int{3 * C}},
			Tensor{p + "attn.c_proj.weight", []int{C, C}},
			Tensor{p + "attn.c_proj.bias", []int{C}},
			Tensor{p + "ln_2.weight", []int{C}},
			Tensor{p + "ln_2.bias", []int{C}},
			Tensor{p + "mlp.c_fc.weight", []int{C, 4 * C}},
			Tensor{p + "mlp.c_fc.bias", []int{4 * C}},
			Tensor{p + "mlp.c_proj.weight", []int{4 * C, C}},
			Tensor{p + "mlp.c_proj.bias", []int{C}})
	}
	ts = append(ts,
		Tensor{"ln_f.weight", []int{C}},
		Tensor{"ln_f.bias", []int{C}})
	return ts
}

// NumParams returns the number of parameters (elements) of Tensors(), the
// LM head counted once since it is tied to wte:
// V*C + NCtx*C + L*(12C² + 13C) + 2C. That is 124,439,808 for GPT-2 small
// with its own vocabulary (V 50257) and 124,475,904 for the gpt2 preset
// (V 50304), the count llm.c reports for its padded model.
func (c Config) NumParams() int {
	V, C, L := c.VocabSize, c.NEmbd, c.NLayer
	return V*C + c.NCtx*C + L*(12*C*C+13*C) + 2*C
}

// FLOPsPerToken returns the floating-point operations of one training
// token (forward and backward) at sequence length T, as llm.c counts them
// for MFU (gpt2_estimate_mfu, after Kaplan et al. 2020, section 2.1):
// 6*N + 6*L*C*T, where N is NumParams. The first term is the matrix
// products with the weights (2 FLOPs per parameter forward, 4 backward; it
// overcounts slightly by including the embeddings' lookups, the biases and
// LayerNorms), the second attention's products with the keys and values.
// MFU is tokens/s × FLOPsPerToken / the device's peak FLOP/s.
func (c Config) FLOPsPerToken(T int) float64 {
	return 6*float64(c.NumParams()) + 6*float64(c.NLayer)*float64(c.NEmbd)*float64(T)
}

// GPT2VocabSize is the number of tokens of GPT-2's byte-level BPE (OpenAI's
// r50k_base encoding): 50,000 merges, 256 byte tokens and <|endoftext|>
// (id 50256).
const GPT2VocabSize = 50257

// PaddedVocabSize is the presets' vocab_size: GPT2VocabSize padded up to a
// multiple of 128, as llm.c pads it (its Vp) so that the matrix products
// with wte have aligned shapes. Ids from GPT2VocabSize up never occur in
// GPT-2 tokenized data (dos train refuses data that holds one). The loss's
// softmax runs over all PaddedVocabSize columns of the logits, as a PyTorch
// GPT2LMHeadModel built from the exported config.json (vocab_size 50304)
// computes it, and as nanoGPT does with its padded 50304; the padding rows
// of wte are trained only through that softmax, which pushes their logits
// down. (llm.c instead runs its softmax over the first 50257 columns only
// and gives the padding probability 0: its losses differ from these by the
// padding's share of the probability, tiny once trained.)
const PaddedVocabSize = 50304

// PadVocab returns v rounded up to a multiple of 128 (llm.c's padding of
// the vocabulary): PadVocab(50257) = 50304, PadVocab(256) = 256.
func PadVocab(v int) int { return (v + 127) / 128 * 128 }

// presets are GPT-2's four sizes, as Hugging Face's gpt2, gpt2-medium,
// gpt2-large and gpt2-xl config.json have them (the vocabulary padded).
var presets = []struct {
	name string
	cfg  Config
}{
	{"gpt2", Config{VocabSize: PaddedVocabSize, NCtx: 1024, NLayer: 12, NHead: 12, NEmbd: 768}},
	{"gpt2-medium", Config{VocabSize: PaddedVocabSize, NCtx: 1024, NLayer: 24, NHead: 16, NEmbd: 1024}},
	{"gpt2-large", Config{VocabSize: PaddedVocabSize, NCtx: 1024, NLayer: 36, NHead: 20, NEmbd: 1280}},
	{"gpt2-xl", Config{VocabSize: PaddedVocabSize, NCtx: 1024, NLayer: 48, NHead: 25, NEmbd: 1600}},
}

// PresetNames returns the names Preset knows, smallest model first: gpt2,
// gpt2-medium, gpt2-large, gpt2-xl.
func PresetNames() []string {
	names := make([]string, len(presets))
	for i, p := range presets {
		names[i] = p.name
	}
	return names
}

// Preset returns the configuration of one of GPT-2's sizes, named as on
// the Hugging Face hub (source: their config.json, i.e. GPT2Config):
//
//	gpt2         12 layers, width  768, 12 heads: 124,475,904 parameters
//	gpt2-medium  24 layers, width 1024, 16 heads: 354,871,296
//	gpt2-large   36 layers, width 1280, 20 heads: 774,090,240
//	gpt2-xl      48 layers, width 1600, 25 heads: 1,557,686,400
//
// all with n_positions 1024 and vocab_size PaddedVocabSize (50304: GPT-2's
// 50257 tokens padded to a multiple of 128; see PaddedVocabSize). The
// counts are NumParams of the padded models.
//
// Errors: an unknown name, with the known ones listed.
func Preset(name string) (Config, error) {
	for _, p := range presets {
		if p.name == name {
			return p.cfg, nil
		}
	}
	return Config{}, fmt.Errorf("gpt: unknown model %q: want one of %s", name, strings.Join(PresetNames(), ", "))
}
