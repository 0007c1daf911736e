package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"regexp"
	"testing"
)

// TestGPTStamp runs everywhere (CI included): the committed gpt2.ptx was
// built from the committed gpt2.cu, and it defines every kernel LoadGPT
// looks up. After editing gpt2.cu, run scripts/build-kernels.sh on the GPU
// machine and commit gpt2.ptx.
func TestGPTStamp(t *testing.T) {
	src, err := os.ReadFile("gpt2.cu")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(src)
	if got, want := GPTStamp(), hex.EncodeToString(sum[:]); got != want {
		t.Fatalf("gpt2.ptx is stamped %q but gpt2.cu hashes to %s: rebuild the PTX (scripts/build-kernels.sh on the GPU machine)", got, want)
	}
	entries := map[string]bool{}
	for _, m := range regexp.MustCompile(`\.entry\s+(\w+)\(`).FindAllSubmatch(gpt2PTX, -1) {
		entries[string(m[1])] = true
	}
	for _, n := range gptNames {
		if !entries[n] {
			t.Errorf("kernel %s missing from gpt2.ptx", n)
		}
	}
	if len(entries) != len(gptNames) {
		t.Errorf("gpt2.ptx defines %d kernels, LoadGPT knows %d", len(entries), len(gptNames))
	}
}
