package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
	"github.com/deepstates/dos/safetensors"
)

// LoadWeights reads, from the checkpoint at path (a root, whose latest
// checkpoint is read, or a step directory) that Train wrote, the model
// configuration and the fp32 master weights of every parameter, in
// Config.Tensors order. It returns the directory read too.
//
// Errors: those of checkpoint.OpenPath and ReadTensor (checksums are
// verified); a checkpoint without the trainer's object or a parameter, or
// whose vocab_size does not fit its tokenizer (TrainConfig.Tokenizer); an
// error wrapping checkpoint.ErrCorrupt, naming the directory and the
// tensor, for master weights that are not finite (offload.CheckState: a
// checksum does not catch a NaN that was saved).
func LoadWeights(path string) (Config, [][]float32, string, error) {
	tc, w, dir, err := loadWeights(path)
	return tc.Model, w, dir, err
}

// loadWeights is LoadWeights returning the whole training configuration
// (the tokenizer with the model).
func loadWeights(path string) (TrainConfig, [][]float32, string, error) {
	c, err := checkpoint.OpenPath(checkpoint.OS, path, 0)
	if errors.Is(err, checkpoint.ErrJobRoot) {
		return TrainConfig{}, nil, "", fmt.Errorf("%w; cut it for one rank first: dos ckpt reshard --gpus 1 %s NEWROOT, then use NEWROOT", err, path)
	}
	if err != nil {
		return TrainConfig{}, nil, "", err
	}
	defer c.Close()
	dir := c.Dir
	var st trainerState
	if err := c.Object("trainer", &st); err != nil {
		return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s was not written by dos train: %w", dir, err)
	}
	cfg := st.Config.Model
	if err := cfg.Validate(); err != nil {
		return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s: %w", dir, err)
	}
	if n := st.Config.GPUs; n > 1 {
		return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s holds one rank's pieces of a job of %d ranks (dos train --gpus %d): the whole model's weights are spread over the ranks' roots: cut the job's root (the parent of the rank roots) for one rank first, dos ckpt reshard --gpus 1 JOBROOT NEWROOT, then use NEWROOT", dir, n, n)
	}
	if err := st.Config.checkVocab(); err != nil {
		return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s: %w", dir, err)
	}
	var weights [][]float32
	for _, p := range cfg.Tensors() {
		// Check the entry before allocating: the manifest, not the trainer
		// object, says how large the tensor is.
		name := offload.MasterName(p.Name)
		e, ok := c.Entry(name)
		if !ok || e.DType != safetensors.F32 || len(e.Shape) != len(p.Shape) {
			return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s: no F32 tensor %q of shape %v", dir, name, p.Shape)
		}
		n := 1
		for i, d := range p.Shape {
			if e.Shape[i] != int64(d) {
				return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s: tensor %q has shape %v, the model config says %v", dir, name, e.Shape, p.Shape)
			}
			n *= d
		}
		w := make([]float32, n)
		if err := c.ReadTensor(name, safetensors.Float32View(w)); err != nil {
			return TrainConfig{}, nil, "", err
		}
		if err := offload.CheckState(name, w); err != nil {
			return TrainConfig{}, nil, "", fmt.Errorf("trainer: %s: %w", dir, err)
		}
		weights = append(weights, w)
	}
	return st.Config, weights, dir, nil
}

// hfConfig is Hugging Face's GPT2Config as config.json spells it.
type hfConfig struct {
	Architectures     []string `json:"architectures"`
	ModelType         string   `json:"model_type"`
	VocabSize         int      `json:"vocab_size"`
	NPositions        int      `json:"n_positions"`
	NCtx              int      `json:"n_ctx"`
	NEmbd             int      `json:"n_embd"`
	NLayer            int      `json:"n_layer"`
	NHead             int      `json:"n_head"`
	NInner            *int     `json:"n_inner"`
	Activation        string   `json:"activation_function"`
	LayerNormEpsilon  float64  `json:"layer_norm_epsilon"`
	ResidPdrop        float64  `json:"resid_pdrop"`
	EmbdPdrop         float64  `json:"embd_pdrop"`
	AttnPdrop         float64  `json:"attn_pdrop"`
	InitializerRange  float64  `json:"initializer_range"`
	TieWordEmbeddings bool     `json:"tie_word_embeddings"`
	BOSTokenID        int      `json:"bos_token_id"`
	EOSTokenID        int      `json:"eos_token_id"`
	TorchDType        string   `json:"torch_dtype"`
}

// ExportHF writes the model of the checkpoint at path as a Hugging Face
// GPT-2 model in outDir: config.json (GPT2Config: gelu_new, layer norm
// epsilon 1e-5, tied embeddings, no dropout) and model.safetensors holding
// every parameter in fp32 under its GPT-2 name (wte.weight, h.0.ln_1.weight,
// ...), which transformers.GPT2LMHeadModel.from_pretrained loads. Its
// bos_token_id and eos_token_id are GPT-2's <|endoftext|> (50256) for a
// model trained with the gpt2 tokenizer, whose Hugging Face tokenizer
// files (HFTokenizerFiles: GPT-2's vocab.json and merges.txt) it writes
// beside the model, so AutoTokenizer.from_pretrained(outDir) works
// offline; vocab_size-1 byte-level.
// A padded vocab_size (50304) is exported as it is: the model's softmax
// runs over every column, as dos's does. It returns the checkpoint
// directory exported.
//
// Errors: those of LoadWeights, and I/O errors writing outDir.
func ExportHF(path, outDir string) (string, error) {
	tc, weights, dir, err := loadWeights(path)
	if err != nil {
		return "", err
	}
	cfg, eos := tc.Model, tc.Model.VocabSize-1 // byte-level: no end-of-text token
	if tc.Tokenizer == "gpt2" {
		eos = gpt2EOT
	}
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return "", err
	}
	js, err := json.MarshalIndent(hfConfig{
		Architectures: []string{"GPT2LMHeadModel"}, ModelType: "gpt2",
		VocabSize: cfg.VocabSize, NPositions: cfg.NCtx, NCtx: cfg.NCtx, NEmbd: cfg.NEmbd, NLayer: cfg.NLayer, NHead: cfg.NHead,
		Activation: "gelu_new", LayerNormEpsilon: LayerNormEps, InitializerRange: 0.02, TieWordEmbeddings: true,
		BOSTokenID: eos, EOSTokenID: eos, TorchDType: "float32",
	}, "", "  ")
	if err != nil {
		return "", err
	}
	var ts []safetensors.Tensor
	for i, p := range cfg.Tensors() {
		shape := make([]int64, len(p.Shape))
		for j, d := range p.Shape {
			shape[j] = int64(d)
		}
		ts = append(ts, safetensors.Tensor{Spec: safetensors.Spec{Name: p.Name, DType: safetensors.F32, Shape: shape}, Data: safetensors.Float32Bytes(weights[i])})
	}
	file, err := safetensors.Encode(map[string]string{"format": "pt"}, ts)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(outDir, "config.json"), append(js, '\n'), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(outDir, "model.safetensors"), file, 0o644); err != nil {
		return "", err
	}
	if tc.Tokenizer == "gpt2" {
		if err := writeGPT2Tokenizer(outDir); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// Logits runs the model cfg with weights on one sequence of tokens
// (len(tokens) <= cfg.NCtx) in float64 and returns its logits,
// [len(tokens) * VocabSize] row-major, and the mean next-token loss over
// the sequence's first len-1 positions (nats; NaN for a single token).
//
// Panics on a token out of range or a sequence longer than cfg.NCtx.
func Logits(cfg Config, weights [][]float32, tokens []int32) ([]float64, float64) {
	T := len(tokens)
	m := NewModel[float64](cfg, 1, T)
	params := make([][]float64, len(weights))
	for i, w := range weights {
		params[i] = make([]float64, len(w))
		for j, x := range w {
			params[i][j] = float64(x)
		}
	}
	m.Forward(params, tokens, nil)
	logits := append([]float64(nil), m.Logits()...)
	var loss float64
	for t := 0; t+1 < T; t++ {
		row := logits[t*cfg.VocabSize : (t+1)*cfg.VocabSize]
		mx := row[0]
		for _, x := range row {
			mx = max(mx, x)
		}
		var z float64
		for _, x := range row {
			z += math.Exp(x - mx)
		}
		loss += mx + math.Log(z) - row[tokens[t+1]]
	}
	if T < 2 {
		return logits, math.NaN()
	}
	return logits, loss / float64(T-1)
}
