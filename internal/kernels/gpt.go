package kernels

import (
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/deepstates/dos/internal/cuda"
)

//go:embed gpt2.ptx
var gpt2PTX []byte

// GPTStamp returns the SHA-256 of gpt2.cu recorded on gpt2.ptx's first
// line, or "" when it is missing.
func GPTStamp() string { return stampOf(gpt2PTX) }

// GPT kernel indices into GPT.fn, in gptNames order.
const (
	gEncoderFwd = iota
	gWpeBwd
	gWteBwd
	gCastBF16
	gLNFwd
	gLNBwd
	gColsumPartial
	gColsumFinish
	gGELUFwd
	gGELUBwd
	gPermuteQKV
	gPermuteQKVBwd
	gUnpermute
	gUnpermuteBwd
	gSoftmaxFwd
	gSoftmaxBwd
	gClassifier
	gFlashFwd
	gFlashBwdPre
	gFlashBwdKV
	gFlashBwdQ
	numGPT
)

var gptNames = [numGPT]string{
	"gpt_encoder_forward", "gpt_wpe_backward", "gpt_wte_backward", "gpt_cast_bf16",
	"gpt_layernorm_forward", "gpt_layernorm_backward", "gpt_colsum_partial", "gpt_colsum_finish",
	"gpt_gelu_forward", "gpt_gelu_backward", "gpt_permute_qkv", "gpt_permute_qkv_backward",
	"gpt_unpermute", "gpt_unpermute_backward", "gpt_softmax_forward", "gpt_softmax_backward",
	"gpt_classifier", "gpt_flash_forward", "gpt_flash_backward_pre", "gpt_flash_backward_kv",
	"gpt_flash_backward_q",
}

// GPT is gpt2.cu loaded on one device: the GPT-2 model's kernels other than
// the matrix products (LayerNorm, GELU, attention's permutes and softmax,
// the classifier, embeddings, column sums), with typed launchers. Every
// launcher enqueues on the given stream and returns at once; pointers are
// raw device addresses (CUdeviceptr) of bf16 ("16") or fp32 arrays as each
// method says; shapes are row-major. The launchers check their integer
// arguments (an error names the kernel), not the pointers: a wrong pointer
// is a device fault that the stream's next synchronization reports.
//
// A GPT is safe for concurrent use: launches serialize on a mutex around
// the argument block. It allocates nothing per launch.
type GPT struct {
	d    *cuda.Device
	mod  *cuda.Module
	fn   [numGPT]*cuda.Function
	grid int // the most blocks of a grid-stride launch

	mu   sync.Mutex
	args *cuda.Args
}

// LoadGPT compiles the embedded gpt2.ptx for d and looks up every kernel.
// With DOS_KERNELS_DIR set (kernel development on the GPU machine), it
// loads that directory's gpt2.ptx instead.
//
// Errors: the driver rejecting the PTX (its log is in the error), a missing
// kernel, a closed device.
func LoadGPT(d *cuda.Device) (*GPT, error) {
	ptx, err := ptxSource("gpt2.ptx", gpt2PTX)
	if err != nil {
		return nil, err
	}
	mod, err := d.LoadModule(ptx)
	if err != nil {
		return nil, fmt.Errorf("kernels: gpt2.ptx: %w", err)
	}
	g := &GPT{d: d, mod: mod, grid: d.SMs * 16}
	for i, name := range gptNames {
		if g.fn[i], err = mod.Function(name); err != nil {
			g.Close()
			return nil, fmt.Errorf("kernels: %w", err)
		}
	}
	if g.args, err = cuda.NewArgs(); err != nil {
		g.Close()
		return nil, fmt.Errorf("kernels: %w", err)
	}
	return g, nil
}

// Close frees the module and the argument block. A second Close does
// nothing.
func (g *GPT) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var first error
	if g.args != nil {
		first = g.args.Free()
		g.args = nil
	}
	if g.mod != nil {
		if err := g.mod.Free(); err != nil && first == nil {
			first = err
		}
		g.mod = nil
	}
	return first
}

// begin locks the argument block and resets it; end launches kernel k and
// unlocks.
func (g *GPT) begin() *cuda.Args {
	g.mu.Lock()
	g.args.Reset()
	return g.args
}

func (g *GPT) end(k int, s *cuda.Stream, grid, block cuda.Dim3) error {
	defer g.mu.Unlock()
	if g.mod == nil {
		return fmt.Errorf("kernels: %s: %w", gptNames[k], cuda.ErrFreed)
	}
	return g.fn[k].Launch(s, grid, block, 0, g.args)
}

// strided is the launch shape of a grid-stride kernel over n elements.
func (g *GPT) strided(n int64) (cuda.Dim3, cuda.Dim3) {
	b := (n + Block - 1) / Block
	if b > int64(g.grid) {
		b = int64(g.grid)
	}
	return cuda.Dim3{X: uint32(max(b, 1)), Y: 1, Z: 1}, cuda.Dim3{X: Block, Y: 1, Z: 1}
}

// rowsPerBlock is the rows of a warp-per-row kernel's block (Block/32).
const rowsPerBlock = Block / 32

// perRow is the launch shape of a warp-per-row kernel over n rows.
func perRow(n int) (cuda.Dim3, cuda.Dim3) {
	return cuda.Dim3{X: uint32((n + rowsPerBlock - 1) / rowsPerBlock), Y: 1, Z: 1}, cuda.Dim3{X: Block, Y: 1, Z: 1}
}

// positive returns an error naming kernel k when a size is not >= 1 or
// exceeds int32.
func positive(k int, vals ...int) error {
	for _, v := range vals {
		if v < 1 || v > 1<<31-1 {
			return fmt.Errorf("kernels: %s: size %d out of range [1, 2^31)", gptNames[k], v)
		}
	}
	return nil
}

// EncoderForward: out[bt, :] = wte[tok[bt], :] + wpe[bt % T, :] (fp32 out
// [BT, C]; tok int32 [BT]; wte [V, C]; wpe [NCtx, C], T <= NCtx; both
// bf16, or both fp32 with f32, as PyTorch's autocast reads the fp32
// embeddings). Source: GPT2Model.forward's inputs_embeds + position_embeds.
func (g *GPT) EncoderForward(s *cuda.Stream, out, tok, wte, wpe uint64, f32 bool, BT, T, C int) error {
	if err := positive(gEncoderFwd, BT, T, C, BT*C); err != nil {
		return err
	}
	grid, block := g.strided(int64(BT) * int64(C))
	g.begin().U64(out).U64(tok).U64(wte).U64(wpe).I32(flag(f32)).I32(int32(BT)).I32(int32(T)).I32(int32(C))
	return g.end(gEncoderFwd, s, grid, block)
}

// WpeBackward: dwpe16 [NCtx, C] = the sum over b of dres [B, T, C] (fp32),
// rows T..NCtx-1 zero.
func (g *GPT) WpeBackward(s *cuda.Stream, dwpe, dres uint64, B, T, NCtx, C int) error {
	if err := positive(gWpeBwd, B, T, NCtx, C, NCtx*C); err != nil {
		return err
	}
	if T > NCtx {
		return fmt.Errorf("kernels: gpt_wpe_backward: T = %d > NCtx = %d", T, NCtx)
	}
	grid, block := g.strided(int64(NCtx) * int64(C))
	g.begin().U64(dwpe).U64(dres).I32(int32(B)).I32(int32(T)).I32(int32(NCtx)).I32(int32(C))
	return g.end(gWpeBwd, s, grid, block)
}

// WteBackward adds to dwte (fp32 [V, C]) the rows of dres (fp32 [BT, C])
// of each token: segment i lists positions pos[seg[i]:seg[i+1]]
// (ascending, int32) of token segTok[i]; nseg segments (seg has nseg+1
// entries). Deterministic: one block per segment, positions in order.
func (g *GPT) WteBackward(s *cuda.Stream, dwte, dres, pos, seg, segTok uint64, nseg, C int) error {
	if err := positive(gWteBwd, nseg, C); err != nil {
		return err
	}
	grid := cuda.Dim3{X: uint32(min(nseg, 1<<20)), Y: 1, Z: 1}
	g.begin().U64(dwte).U64(dres).U64(pos).U64(seg).U64(segTok).I32(int32(nseg)).I32(int32(C))
	return g.end(gWteBwd, s, grid, cuda.Dim3{X: Block, Y: 1, Z: 1})
}

// CastBF16: out16[i] = bf16(in[i]) (round to nearest even), n elements.
func (g *GPT) CastBF16(s *cuda.Stream, out, in uint64, n int64) error {
	if n < 1 {
		return fmt.Errorf("kernels: gpt_cast_bf16: %d elements", n)
	}
	grid, block := g.strided(n)
	g.begin().U64(out).U64(in).U64(uint64(n))
	return g.end(gCastBF16, s, grid, block)
}

// LayerNormForward normalizes N rows of width C (eps 1e-5, biased
// variance): out16 = (x - mean) * rstd * w + b, mean and rstd fp32 [N]
// kept for backward; w and b [C] both bf16, or both fp32 with f32 (as
// PyTorch's autocast runs layer_norm with fp32 parameters). With y16 != 0 it first adds the residual: resOut =
// resIn + y16 (fp32; resOut may be resIn) and normalizes resOut; with y16
// == 0 it normalizes resIn and resOut is unused. Source: torch.nn.LayerNorm,
// fused with the residual add as llm.c's fused_residual_forward.
func (g *GPT) LayerNormForward(s *cuda.Stream, out, mean, rstd, resOut, resIn, y, w, b uint64, f32 bool, N, C int) error {
	if err := positive(gLNFwd, N, C); err != nil {
		return err
	}
	grid, block := perRow(N)
	g.begin().U64(out).U64(mean).U64(rstd).U64(resOut).U64(resIn).U64(y).U64(w).U64(b).I32(flag(f32)).I32(int32(N)).I32(int32(C))
	return g.end(gLNFwd, s, grid, block)
}

// LayerNormBackward computes the gradient of LayerNormForward's input from
// dout16 [N, C], the input inp (fp32), w (bf16, or fp32 with f32), mean
// and rstd: dres = dx, or dres += dx with accumulate (fp32 [N, C]);
// dres16, when not 0, receives bf16(dres). The parameter gradients are
// ColSum's (LayerNorm mode).
func (g *GPT) LayerNormBackward(s *cuda.Stream, dres, dres16, dout, inp, w uint64, f32 bool, mean, rstd uint64, accumulate bool, N, C int) error {
	if err := positive(gLNBwd, N, C); err != nil {
		return err
	}
	grid, block := perRow(N)
	g.begin().U64(dres).U64(dres16).U64(dout).U64(inp).U64(w).I32(flag(f32)).U64(mean).U64(rstd).I32(flag(accumulate)).I32(int32(N)).I32(int32(C))
	return g.end(gLNBwd, s, grid, block)
}

// ColSumChunks is the number of row chunks ColSum's first stage uses; its
// part buffer needs ColSumChunks * 2 * C floats (LayerNorm mode) or
// ColSumChunks * C.
const ColSumChunks = 64

// ColSum writes column sums of dout16 [N, C] in two deterministic stages
// (per-chunk partial sums into part, fp32, then their sum in chunk order):
// db16[c] = sum over rows of dout[r, c] (a bias gradient); with inp != 0
// (LayerNorm mode: inp fp32 [N, C], mean and rstd fp32 [N]) also dw16[c] =
// sum of dout[r, c] * (inp[r, c] - mean[r]) * rstd[r] (LayerNorm's weight
// gradient; db is then its bias gradient). dw must be 0 without inp.
func (g *GPT) ColSum(s *cuda.Stream, db, dw, part, dout, inp, mean, rstd uint64, N, C int) error {
	if err := positive(gColsumPartial, N, C); err != nil {
		return err
	}
	if (inp == 0) != (dw == 0) {
		return fmt.Errorf("kernels: gpt_colsum_partial: dw and inp go together")
	}
	R := min(ColSumChunks, N)
	rows := (N + R - 1) / R
	R = (N + rows - 1) / rows
	g.begin().U64(part).U64(dout).U64(inp).U64(mean).U64(rstd).I32(int32(N)).I32(int32(C)).I32(int32(rows))
	err := g.end(gColsumPartial, s, cuda.Dim3{X: uint32((C + 31) / 32), Y: uint32(R), Z: 1}, cuda.Dim3{X: 32, Y: 8, Z: 1})
	if err != nil {
		return err
	}
	grid, block := g.strided(int64(C))
	g.begin().U64(db).U64(dw).U64(part).I32(int32(R)).I32(int32(C))
	return g.end(gColsumFinish, s, grid, block)
}

// GELUForward: out16 = gelu_tanh(inp16), n elements (HF NewGELUActivation,
// "gelu_new").
func (g *GPT) GELUForward(s *cuda.Stream, out, inp uint64, n int64) error {
	if n < 1 {
		return fmt.Errorf("kernels: gpt_gelu_forward: %d elements", n)
	}
	grid, block := g.strided(n)
	g.begin().U64(out).U64(inp).U64(uint64(n))
	return g.end(gGELUFwd, s, grid, block)
}

// GELUBackward: dinp16 = dout16 * gelu_tanh'(inp16), n elements.
func (g *GPT) GELUBackward(s *cuda.Stream, dinp, inp, dout uint64, n int64) error {
	if n < 1 {
		return fmt.Errorf("kernels: gpt_gelu_backward: %d elements", n)
	}
	grid, block := g.strided(n)
	g.begin().U64(dinp).U64(inp).U64(dout).U64(uint64(n))
	return g.end(gGELUBwd, s, grid, block)
}

// attnShape checks B, T, NH, HS and returns the element count.
func attnShape(k, B, T, NH, HS int) (int64, error) {
	if err := positive(k, B, T, NH, HS); err != nil {
		return 0, err
	}
	return int64(B) * int64(T) * int64(NH) * int64(HS), nil
}

// PermuteQKV splits qkv16 [B, T, 3, NH, HS] (c_attn's output) into q16, k16,
// v16 [B, NH, T, HS].
func (g *GPT) PermuteQKV(s *cuda.Stream, q, k, v, qkv uint64, B, T, NH, HS int) error {
	n, err := attnShape(gPermuteQKV, B, T, NH, HS)
	if err != nil {
		return err
	}
	grid, block := g.strided(n)
	g.begin().U64(q).U64(k).U64(v).U64(qkv).I32(int32(B)).I32(int32(T)).I32(int32(NH)).I32(int32(HS))
	return g.end(gPermuteQKV, s, grid, block)
}

// PermuteQKVBackward is PermuteQKV's inverse: dqkv16 from dq16, dk16, dv16.
func (g *GPT) PermuteQKVBackward(s *cuda.Stream, dqkv, dq, dk, dv uint64, B, T, NH, HS int) error {
	n, err := attnShape(gPermuteQKVBwd, B, T, NH, HS)
	if err != nil {
		return err
	}
	grid, block := g.strided(n)
	g.begin().U64(dqkv).U64(dq).U64(dk).U64(dv).I32(int32(B)).I32(int32(T)).I32(int32(NH)).I32(int32(HS))
	return g.end(gPermuteQKVBwd, s, grid, block)
}

// Unpermute: out16 [B, T, NH, HS] = y16 [B, NH, T, HS].
func (g *GPT) Unpermute(s *cuda.Stream, out, y uint64, B, T, NH, HS int) error {
	n, err := attnShape(gUnpermute, B, T, NH, HS)
	if err != nil {
		return err
	}
	grid, block := g.strided(n)
	g.begin().U64(out).U64(y).I32(int32(B)).I32(int32(T)).I32(int32(NH)).I32(int32(HS))
	return g.end(gUnpermute, s, grid, block)
}

// UnpermuteBackward: dy16 [B, NH, T, HS] = dout16 [B, T, NH, HS].
func (g *GPT) UnpermuteBackward(s *cuda.Stream, dy, dout uint64, B, T, NH, HS int) error {
	n, err := attnShape(gUnpermuteBwd, B, T, NH, HS)
	if err != nil {
		return err
	}
	grid, block := g.strided(n)
	g.begin().U64(dy).U64(dout).I32(int32(B)).I32(int32(T)).I32(int32(NH)).I32(int32(HS))
	return g.end(gUnpermuteBwd, s, grid, block)
}

// SoftmaxForward: the causal softmax of pre (fp32 [rows, T], already
// scaled) into att16 [rows, T]; row r is query position r % T, and
// columns beyond it are 0.
func (g *GPT) SoftmaxForward(s *cuda.Stream, att, pre uint64, rows, T int) error {
	if err := positive(gSoftmaxFwd, rows, T); err != nil {
		return err
	}
	grid, block := perRow(rows)
	g.begin().U64(att).U64(pre).I32(int32(rows)).I32(int32(T))
	return g.end(gSoftmaxFwd, s, grid, block)
}

// SoftmaxBackward: dpre16 = att * (datt - rowsum(att * datt)) * scale on
// the causal part, 0 beyond (att16 [rows, T], datt fp32 [rows, T]).
func (g *GPT) SoftmaxBackward(s *cuda.Stream, dpre, datt, att uint64, scale float32, rows, T int) error {
	if err := positive(gSoftmaxBwd, rows, T); err != nil {
		return err
	}
	grid, block := perRow(rows)
	g.begin().U64(dpre).U64(datt).U64(att).F32(scale).I32(int32(rows)).I32(int32(T))
	return g.end(gSoftmaxBwd, s, grid, block)
}

// Classifier computes each row's cross-entropy of logits16 [N, V] against
// targets (int32 [N], each in [0, V)) into losses (fp32 [N], nats) and,
// when dloss != 0, overwrites the logits with their gradient (softmax -
// onehot) * dloss in bf16, without materializing fp32 probabilities.
// Source: torch.nn.functional.cross_entropy; llm.c's fused_classifier.
func (g *GPT) Classifier(s *cuda.Stream, logits, losses, targets uint64, dloss float32, N, V int) error {
	if err := positive(gClassifier, N, V); err != nil {
		return err
	}
	g.begin().U64(logits).U64(losses).U64(targets).F32(dloss).I32(int32(V))
	return g.end(gClassifier, s, cuda.Dim3{X: uint32(N), Y: 1, Z: 1}, cuda.Dim3{X: 1024, Y: 1, Z: 1})
}

// KernelsDirEnv names the environment variable that points LoadGPT at a
// directory of freshly built PTX (scripts/build-kernels.sh's output)
// instead of the embedded one: kernel development on the GPU machine,
// without a Go toolchain there.
const KernelsDirEnv = "DOS_KERNELS_DIR"

// ptxSource returns the embedded PTX, or name from $DOS_KERNELS_DIR.
func ptxSource(name string, embedded []byte) ([]byte, error) {
	dir := os.Getenv(KernelsDirEnv)
	if dir == "" {
		return embedded, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return nil, fmt.Errorf("kernels: %s is set: %w", KernelsDirEnv, err)
	}
	return b, nil
}

// FlashHeadSize is the head size the flash-attention kernels take.
const FlashHeadSize = 64

// flashGrid is the launch shape of the flash-attention kernels: a block of
// 128 threads per 64-row tile of each (b, h).
func flashGrid(B, T, NH int) (cuda.Dim3, cuda.Dim3) {
	return cuda.Dim3{X: uint32((T + 63) / 64), Y: uint32(B * NH), Z: 1}, cuda.Dim3{X: 128, Y: 1, Z: 1}
}

// FlashForward is causal self-attention for head size 64 without the T×T
// matrices in memory (FlashAttention-2's forward, on bf16 tensor cores):
// q, k, v are read in place from qkv16 [B, T, 3, NH, 64] (c_attn's output),
// the output goes to out16 [B, T, NH, 64] (c_proj's input), and lse (fp32
// [B, NH, T]) keeps each row's log-sum-exp of the scaled scores for
// FlashBackward. scale is 1/sqrt(64). Deterministic.
func (g *GPT) FlashForward(s *cuda.Stream, out, lse, qkv uint64, B, T, NH int, scale float32) error {
	if err := positive(gFlashFwd, B, T, NH); err != nil {
		return err
	}
	grid, block := flashGrid(B, T, NH)
	g.begin().U64(out).U64(lse).U64(qkv).I32(int32(B)).I32(int32(T)).I32(int32(NH)).F32(scale)
	return g.end(gFlashFwd, s, grid, block)
}

// FlashBackward is FlashForward's backward: from qkv16, its output out16,
// the output's gradient dout16 [B, T, NH, 64] and lse, it writes dqkv16
// [B, T, 3, NH, 64] (every element), using D (fp32 [B, NH, T]) as scratch
// for rowsum(dout ∘ out). Three launches, no atomics: deterministic.
func (g *GPT) FlashBackward(s *cuda.Stream, dqkv, qkv, out, dout, lse, D uint64, B, T, NH int, scale float32) error {
	if err := positive(gFlashBwdPre, B, T, NH, B*T*NH); err != nil {
		return err
	}
	grid, block := perRow(B * T * NH)
	g.begin().U64(D).U64(out).U64(dout).I32(int32(B)).I32(int32(T)).I32(int32(NH))
	if err := g.end(gFlashBwdPre, s, grid, block); err != nil {
		return err
	}
	grid, block = flashGrid(B, T, NH)
	for _, k := range []int{gFlashBwdKV, gFlashBwdQ} {
		g.begin().U64(dqkv).U64(qkv).U64(dout).U64(lse).U64(D).I32(int32(B)).I32(int32(T)).I32(int32(NH)).F32(scale)
		if err := g.end(k, s, grid, block); err != nil {
			return err
		}
	}
	return nil
}

// flag is a kernel's int flag: 1 for true.
func flag(b bool) int32 {
	if b {
		return 1
	}
	return 0
}
