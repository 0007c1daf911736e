package gptcuda

import "testing"

// TestFusedGELUWidths: the GELU epilogues' auxiliary output needs 4C a
// multiple of 8; at other widths New runs the GELU kernels instead, and
// every product it builds is valid.
func TestFusedGELUWidths(t *testing.T) {
	for _, tc := range []struct {
		C     int
		fused bool
	}{{8, true}, {9, false}, {15, false}, {768, true}, {1600, true}} {
		fused := Options{}.fusedGELU(tc.C)
		if fused != tc.fused {
			t.Errorf("C=%d: fused GELU %v, want %v", tc.C, fused, tc.fused)
		}
		m := &Model{b: 2, t: 16, bt: 32, c: tc.C, nh: 1, hs: tc.C, v: 256, l: 1, fusedGELU: fused}
		m.buildGEMMs()
		gemms := map[string]error{"qkv": m.gemm.qkv.Validate(), "fc": m.gemm.fc.Validate(), "logits": m.gemm.logits.Validate()}
		if fused {
			gemms["fcGELU"], gemms["dXGELU"] = m.gemm.fcGELU.Validate(), m.gemm.dXGELU.Validate()
		}
		for name, err := range gemms {
			if err != nil {
				t.Errorf("C=%d: the %s product is invalid: %v", tc.C, name, err)
			}
		}
	}
	if (Options{SeparateGELU: true}).fusedGELU(768) {
		t.Error("SeparateGELU did not separate")
	}
}
