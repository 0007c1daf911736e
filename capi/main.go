// Command capi is dos's C API for other languages, built as a shared
// library (go build -buildmode=c-shared -o python/dos/libdos.so ./capi;
// `make python`): the offloaded AdamW of package offload behind a few C
// functions that the Python package dos (python/dos) calls through ctypes.
// It is the one artifact built with cgo; the dos CLI stays CGO-free.
//
// The functions (capi.go; their C declarations are in the generated
// libdos.h):
//
//	int64_t dos_adamw_new(const char *spec, char **err);
//	int32_t dos_adamw_step(int64_t h, int32_t nparams, void **params, const int64_t *param_lens, const void **grads, const int64_t *grad_lens, const double *lrs, int32_t ngroups, double loss_scale, dos_reduce_fn reduce, char **err);
//	int32_t dos_adamw_device_ptrs(int64_t h, int32_t i, uint64_t *grad, uint64_t *working, char **err);
//	int32_t dos_adamw_step_device(int64_t h, const double *lrs, int32_t ngroups, double loss_scale, dos_reduce_fn reduce, char **err);
//	int32_t dos_adamw_state_get(int64_t h, int32_t i, int32_t kind, float *data, int64_t n, char **err);
//	int32_t dos_adamw_state_set(int64_t h, int32_t i, int32_t kind, const float *data, int64_t n, char **err);
//	int64_t dos_adamw_get_step(int64_t h, char **err);
//	int32_t dos_adamw_set_step(int64_t h, int64_t step, char **err);
//	int64_t dos_adamw_save(int64_t h, const char *root, const char *objects_json, int32_t keep, int64_t ring_bytes, char **err);
//	int32_t dos_save_done(int64_t save);
//	int32_t dos_save_wait(int64_t save, char **dir, char **err);
//	void dos_save_free(int64_t save);
//	int32_t dos_adamw_load(int64_t h, const char *path, char **objects_json, char **err);
//	int32_t dos_adamw_placement(int64_t h, char **json, char **err);
//	int32_t dos_adamw_close(int64_t h, char **err); /* waits for the last save; its failure is the error, returned again (once) by a second close of h */
//	void dos_free(char *p);
//	const char *dos_version(void);
//	int32_t dos_lock_fds(int32_t *fds, int32_t n);
//	int32_t dos_fork_prepare(int32_t *fds, int32_t n);
//	void dos_fork_done(void);
//
// params and grads point to each of the nparams parameters' data and
// gradient in the spec's dtype (float32, or 16-bit with fp32 master
// weights in dos) in host memory; param_lens and grad_lens are their
// element counts, which must be the parameter's (an error otherwise,
// before any buffer is read). A buffer must stay valid until the call
// returns. With a CUDA device, dos_adamw_device_ptrs gives a
// parameter's gradient and weights in the optimizer's device memory
// (offload.Optimizer.DeviceGrad, and DeviceWorking for 16-bit parameters or
// DeviceMaster for float32 ones with the spec's device_params): the caller writes
// the gradients there, calls dos_adamw_step_device (a Step with
// StepArgs.GradOnDevice, after SyncDevice; it returns when the update is
// complete on the device), then reads the new weights there. reduce, when
// not NULL, is int32_t (*)(double *sum_squares): the caller's all-reduce
// (sum) of the gradients' sum of squares over the ranks that each hold a
// shard of the model (NaN from a rank with a non-finite gradient), called
// once per step on the calling thread, so that every rank clips by the
// whole model's norm and skips alike (offload.StepArgs.Reduce); NULL when
// the optimizer holds the whole model. The
// state functions take fp32 (kind 0 sets the master weights, as after
// dos_adamw_new, which starts them at zero). kind is 0 (the fp32 master weights), 1 (exp_avg), 2 (exp_avg_sq) or 3
// (max_exp_avg_sq, amsgrad only). A handle (int64_t, > 0) names one
// optimizer, another one a lazy save (offload.Optimizer.SaveAsync into
// a checkpoint.Engine on the root, DataStates-LLM): dos_save_wait returns
// when it is durable, with its directory. Errors come back as a
// malloc'd message in *err, which the caller frees with dos_free, and a
// return value of 0 (dos_adamw_new) or -1; no function panics across the
// boundary (a Go panic becomes an error message).
package main

func main() {}
