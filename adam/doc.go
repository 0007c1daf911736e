// Package adam holds the AdamW arithmetic of dos: the hyperparameters as
// PyTorch names them, one optimizer step over flat fp32 buffers, the exact
// fp16/bf16 conversions, the non-finite check and the sum of squares used for
// clipping, and a worker pool that splits a large subgroup across goroutines.
//
// It knows nothing of devices: every buffer is a Go slice in host memory.
//
// # Semantics
//
// Step follows torch.optim.AdamW (Mode AdamW, decoupled weight decay) and
// torch.optim.Adam (Mode Adam, L2 weight decay) as their single-tensor CPU
// implementation (_single_tensor_adam, foreach=False) computes them in fp32.
// For step t (the counter after it advanced) and per element, with every
// scalar rounded to fp32 once, as ATen does when a Python float meets an fp32
// tensor:
//
//	g = float32(grad) * unscale * clip     (each product rounded to fp32)
//	g = -g                                 if maximize
//	p = p * (1 - lr*weight_decay)          Mode AdamW
//	g = g + weight_decay*p                 Mode Adam, weight_decay != 0
//	m = lerp(m, g, 1-beta1)                exp_avg
//	v = v*beta2 + (1-beta2)*g*g            exp_avg_sq
//	vmax = max(vmax, v); v' = vmax         if amsgrad, else v' = v
//	denom = sqrt(v') / sqrt(1-beta2^t) + eps
//	p = p + (-lr/(1-beta1^t)) * m / denom
//
// The bias corrections are computed in float64, as Python does, and then
// rounded. The optional 16-bit working copy is the new p rounded to nearest
// even (bf16 or fp16); NaN stays NaN.
//
// References:
//   - Loshchilov, Hutter. Decoupled Weight Decay Regularization. ICLR 2019.
//   - Kingma, Ba. Adam: A Method for Stochastic Optimization. ICLR 2015.
//   - Reddi, Kale, Kumar. On the Convergence of Adam and Beyond (amsgrad). ICLR 2018.
//   - PyTorch torch/optim/adam.py, _single_tensor_adam; ATen's lerp, addcmul and addcdiv CPU kernels.
package adam
