// Fake CUDA for torch's CPU wheel: just enough for FakeTensorMode's `cuda` tensors to go through autograd.
//
// Loaded with ctypes (RTLD_GLOBAL) before `import torch`, so its static initialisers register into libtorch's
// registries before torch creates its CUDA hooks (once, at import). It defines no kernels and moves no data:
//   - a CUDA device guard (c10's FakeGuardImpl: one device, streams and events that do nothing). Without it, the
//     first op autograd records on a cuda tensor terminates the process ("not linked with support for cuda").
//   - CUDA hooks that say "built, but no device available": backward asks the accelerator for its current stream
//     (InputBuffer::add) and refuses an accelerator that is not built. isAvailable stays false so that
//     torch.cuda.is_available() keeps telling the truth and nothing tries to initialise a real CUDA runtime.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace moetron_dryrun {

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
};

}  // namespace moetron_dryrun

// The registry lives in namespace at; torch asks it for "CUDAHooks" once, when it first needs the CUDA hooks.
namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", moetron_dryrun::FakeCUDAHooks)
}  // namespace at

namespace {
// One guard object for the process's life: the registry keeps a raw pointer to it.
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;
const c10::impl::DeviceGuardImplRegistrar register_fake_cuda_guard(c10::DeviceType::CUDA, &fake_cuda_guard);
}  // namespace

// A symbol to look up after loading: proves this library (not another) is the one loaded.
extern "C" int moetron_fake_cuda_shim_version() { return 1; }
