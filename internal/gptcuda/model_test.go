package gptcuda

import (
	"strings"
	"testing"

	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/internal/cublas"
)

// TestMemoryBytes counts the arrays of a small model by hand.
func TestMemoryBytes(t *testing.T) {
	c := gpt.Config{VocabSize: 128, NCtx: 64, NLayer: 2, NHead: 2, NEmbd: 128} // head size 64
	B, T := 2, 64
	L, BT, C, V := int64(2), int64(128), int64(128), int64(128)
	rows := int64(B) * 2 * int64(T)
	common := 4*(L+1)*BT*C + 4*L*BT*C + // residual streams
		2*2*L*BT*C + 2*4*L*2*BT + // ln_1, ln_2 and their statistics
		2*L*BT*3*C + 2*L*BT*C + 2*2*L*BT*4*C + // qkv, atty, fch, fchg
		2*BT*C + 4*2*BT + 2*BT*V + 2*BT*C + // ln_f, its statistics, logits, yproj
		4*BT*C + 2*2*BT*C + 2*2*BT*4*C + 4*V*C + 4*64*2*4*C + 4*BT + // backward scratch
		cublas.WorkspaceBytes
	if got, want := MemoryBytes(c, B, T, Options{Attention: AttentionFlash}), common+4*L*rows+4*rows; got != want {
		t.Errorf("flash: MemoryBytes = %d, want %d", got, want)
	}
	att := rows * int64(T)
	if got, want := MemoryBytes(c, B, T, Options{Attention: AttentionCuBLAS}), common+2*L*att+7*2*BT*C+4*att+2*att; got != want {
		t.Errorf("cublas: MemoryBytes = %d, want %d", got, want)
	}
	perBlock := 4*BT*C + 2*2*BT*C + 2*4*2*BT + 2*BT*3*C + 2*BT*C + 2*2*BT*4*C + 4*rows // resid2, ln_1, ln_2, stats, qkv, atty, fch, fchg, lse
	if got, want := MemoryBytes(c, B, T, Options{Attention: AttentionFlash, Recompute: true}), common+4*L*rows+4*rows-(L-1)*perBlock; got != want {
		t.Errorf("flash, recomputing: MemoryBytes = %d, want %d (one block's activations)", got, want)
	}
	if got := MemoryBytes(gpt.Config{VocabSize: 8, NCtx: 8, NLayer: 1, NHead: 2, NEmbd: 32}, 1, 8, Options{Attention: AttentionFlash}); got != 0 {
		t.Errorf("flash at head size 16: MemoryBytes = %d, want 0 (refused)", got)
	}
}

func TestOptions(t *testing.T) {
	for _, tc := range []struct {
		a    Attention
		hs   int
		want Attention
		err  string
	}{
		{AttentionAuto, 64, AttentionFlash, ""},
		{AttentionAuto, 16, AttentionCuBLAS, ""},
		{AttentionFlash, 64, AttentionFlash, ""},
		{AttentionFlash, 32, 0, "head size 64, not 32"},
		{AttentionCuBLAS, 64, AttentionCuBLAS, ""},
		{Attention(9), 64, 0, "unknown Attention(9)"},
	} {
		got, err := Options{Attention: tc.a}.resolve(tc.hs)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%v at head size %d: error %v, want %q", tc.a, tc.hs, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%v at head size %d: %v, %v; want %v", tc.a, tc.hs, got, err, tc.want)
		}
	}
}
