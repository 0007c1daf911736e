package gpt

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// TestPresets: the four sizes have GPT-2's shapes and the parameter counts
// computed from the tensors' shapes (llm.c reports 124,475,904 for the
// padded gpt2), and FLOPsPerToken is llm.c's 6N + 6LCT.
func TestPresets(t *testing.T) {
	if got, want := PresetNames(), []string{"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}; !slices.Equal(got, want) {
		t.Fatalf("PresetNames() = %v, want %v", got, want)
	}
	for _, tc := range []struct {
		name         string
		L, C, H      int
		params       int
		flops1024    float64
		flopsByShape float64
	}{
		{"gpt2", 12, 768, 12, 124_475_904, 803_478_528, 6*124_475_904 + 6*12*768*1024},
		{"gpt2-medium", 24, 1024, 16, 354_871_296, 0, 6*354_871_296 + 6*24*1024*1024},
		{"gpt2-large", 36, 1280, 20, 774_090_240, 0, 6*774_090_240 + 6*36*1280*1024},
		{"gpt2-xl", 48, 1600, 25, 1_557_686_400, 0, 6*1_557_686_400 + 6*48*1600*1024},
	} {
		c, err := Preset(tc.name)
		if err != nil {
			t.Fatal(err)
		}
		want := Config{VocabSize: 50304, NCtx: 1024, NLayer: tc.L, NHead: tc.H, NEmbd: tc.C}
		if c != want {
			t.Errorf("Preset(%q) = %+v, want %+v", tc.name, c, want)
		}
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		total := 0
		for _, p := range c.Tensors() {
			total += p.Numel()
		}
		if total != tc.params || c.NumParams() != tc.params {
			t.Errorf("%s: sum of shapes %d, NumParams %d, want %d", tc.name, total, c.NumParams(), tc.params)
		}
		if got := c.FLOPsPerToken(1024); got != tc.flopsByShape || (tc.flops1024 != 0 && got != tc.flops1024) {
			t.Errorf("%s: FLOPsPerToken(1024) = %v, want %v", tc.name, got, tc.flopsByShape)
		}
	}
	if c, _ := Preset("gpt2-xl"); c.NumParams() < 1.557e9 || c.NumParams() > 1.558e9 {
		t.Errorf("gpt2-xl has %d parameters, want about 1.558B", c.NumParams())
	}
	for _, bad := range []string{"", "GPT2", "gpt2-small", "gpt3"} {
		_, err := Preset(bad)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", bad)) || !strings.Contains(err.Error(), "gpt2, gpt2-medium, gpt2-large, gpt2-xl") {
			t.Errorf("Preset(%q) = %v, want an error naming it and listing the presets", bad, err)
		}
	}
}

func TestPadVocab(t *testing.T) {
	for v, want := range map[int]int{1: 128, 128: 128, 129: 256, 256: 256, GPT2VocabSize: PaddedVocabSize} {
		if got := PadVocab(v); got != want {
			t.Errorf("PadVocab(%d) = %d, want %d", v, got, want)
		}
	}
}

// TestTensors: GPT-2 small's tensors in order, with HF's names and shapes,
// and the index constants pointing at them.
func TestTensors(t *testing.T) {
	c := Config{VocabSize: 50257, NCtx: 1024, NLayer: 12, NHead: 12, NEmbd: 768}
	ts := c.Tensors()
	if len(ts) != 2+12*12+2 || c.NumTensors() != len(ts) {
		t.Fatalf("%d tensors, NumTensors %d, want %d", len(ts), c.NumTensors(), 2+12*12+2)
	}
	if c.NumParams() != 124_439_808 {
		t.Errorf("NumParams = %d, want 124,439,808", c.NumParams())
	}
	got := func(i int) string { return fmt.Sprint(ts[i].Name, ts[i].Shape) }
	for i, w := range map[int]string{
		Wte:                        "wte.weight[50257 768]",
		Wpe:                        "wpe.weight[1024 768]",
		LayerBase(0) + Ln1W:        "h.0.ln_1.weight[768]",
		LayerBase(0) + Ln1B:        "h.0.ln_1.bias[768]",
		LayerBase(0) + AttnW:       "h.0.attn.c_attn.weight[768 2304]",
		LayerBase(0) + AttnB:       "h.0.attn.c_attn.bias[2304]",
		LayerBase(0) + AttnProjW:   "h.0.attn.c_proj.weight[768 768]",
		LayerBase(0) + AttnProjB:   "h.0.attn.c_proj.bias[768]",
		LayerBase(0) + Ln2W:        "h.0.ln_2.weight[768]",
		LayerBase(0) + Ln2B:        "h.0.ln_2.bias[768]",
		LayerBase(0) + FcW:         "h.0.mlp.c_fc.weight[768 3072]",
		LayerBase(0) + FcB:         "h.0.mlp.c_fc.bias[3072]",
		LayerBase(0) + FcProjW:     "h.0.mlp.c_proj.weight[3072 768]",
		LayerBase(0) + FcProjB:     "h.0.mlp.c_proj.bias[768]",
		LayerBase(1):               "h.1.ln_1.weight[768]",
		LayerBase(11) + FcProjB:    "h.11.mlp.c_proj.bias[768]",
		LayerBase(c.NLayer) + LnfW: "ln_f.weight[768]",
		LayerBase(c.NLayer) + LnfB: "ln_f.bias[768]",
	} {
		if got(i) != w {
			t.Errorf("Tensors()[%d] = %s, want %s", i, got(i), w)
		}
	}
	if LayerBase(1)-LayerBase(0) != PerLayer || PerLayer != FcProjB+1 {
		t.Errorf("PerLayer %d, LayerBase step %d", PerLayer, LayerBase(1)-LayerBase(0))
	}
}

func TestValidate(t *testing.T) {
	ok := Config{VocabSize: 10, NCtx: 8, NLayer: 1, NHead: 2, NEmbd: 4}
	if err := ok.Validate(); err != nil {
		t.Fatalf("%+v: %v", ok, err)
	}
	for _, tc := range []struct {
		mod  func(*Config)
		want string
	}{
		{func(c *Config) { c.VocabSize = 0 }, "vocab_size = 0, want 1..16777216"},
		{func(c *Config) { c.VocabSize = MaxVocabSize + 1 }, "vocab_size = 16777217"},
		{func(c *Config) { c.NCtx = -1 }, "n_positions = -1"},
		{func(c *Config) { c.NLayer = 0 }, "n_layer = 0"},
		{func(c *Config) { c.NLayer = MaxNLayer + 1 }, "n_layer = 1025"},
		{func(c *Config) { c.NHead = 0 }, "n_head = 0"},
		{func(c *Config) { c.NHead = 8 }, "n_head = 8, want 1..4"},
		{func(c *Config) { c.NEmbd = 0 }, "n_embd = 0"},
		{func(c *Config) { c.NEmbd = MaxNEmbd * 2 }, "n_embd = 131072"},
		{func(c *Config) { c.NHead = 3 }, "n_embd = 4 is not a multiple of n_head = 3"},
	} {
		c := ok
		tc.mod(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: Validate() = %v, want an error containing %q", c, err, tc.want)
		}
	}
}

// TestConfigJSON: the JSON names are GPT2Config's.
func TestConfigJSON(t *testing.T) {
	c, _ := Preset("gpt2")
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"vocab_size":50304,"n_positions":1024,"n_layer":12,"n_head":12,"n_embd":768}`; string(b) != want {
		t.Errorf("json %s, want %s", b, want)
	}
}
