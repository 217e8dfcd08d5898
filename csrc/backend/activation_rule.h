// The activation rule of a layer's FFN, written once for every path that computes neurons: which neurons count
// and the coefficient h of their down row. SiLU (GELU): |silu(gate + b)| > threshold; ReLU and FATReLU: gate + b >
// threshold; dReLU: gate > 0 and up > 0; an ungated FFN's "gate" is its up projection.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/exp_ref.h"
#include "kernels/kernels.h"
#include "model/model.h"

namespace pi {

// A thresholded activation (SiLU by its kernel, GELU) of n values in place: every path gets the same bits.
inline void activate_thresholded(const KernelSet &ks, Activation act, int64_t n, float *v) {
    if (act == Activation::Silu) ks.silu(int(n), v, v);
    else
        for (int64_t i = 0; i < n; ++i) v[i] = gelu_ref(v[i]);
}

// v when keep, else +0, by masking its bits: at moderate sparsity `keep` is a coin flip, and a branch
// on it (what compilers make of `keep ? v : 0`) mispredicts half the time.
inline float keep_if(bool keep, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits &= 0u - uint32_t(keep);
    std::memcpy(&v, &bits, 4);
    return v;
}

struct ActivationRule {
    Activation act;
    float thr;
    bool gated;
    const float *gate_b, *up_b;  // per neuron id (nullptr: no bias)
    const int32_t *ids;          // the neuron id of each of the tier's slots
    const KernelSet *ks;

    ActivationRule(const HParams &hp, const Layer &L, const FfnTier &T, const KernelSet &kernels)
        : act(hp.activation), thr(L.act_threshold), gated(hp.gated), gate_b(L.gate_b.floats()),
          up_b(L.up_b.floats()), ids(T.ids.data()), ks(&kernels) {}

    // The llama family without biases: the gate's value alone (SiLU'd by `activate`, raw for ReLU) decides, and
    // is the activation of a neuron that passes.
    bool plain() const { return gated && act != Activation::DRelu && !gate_b && !up_b; }
    bool gate_passes(float v) const { return thresholded(act) ? std::fabs(v) > thr : v > thr; }
    // The pre-activation of neuron slot r (the gate of a gated FFN, up otherwise) plus its bias.
    float with_bias(float v, const float *bias, int64_t r) const { return bias ? v + bias[ids[r]] : v; }
    float up_value(float u, int64_t r) const { return with_bias(u, up_b, r); }
    // SiLU (GELU) of n gate values in place (biases added first; slot(j): the neuron slot of value j), by
    // activate_thresholded. Other activations keep their pre-activations for gate_rule.
    template <class Slot>
    void activate(float *v, int64_t n, Slot slot) const {
        if (!thresholded(act)) return;
        if (gate_b)
            for (int64_t j = 0; j < n; ++j) v[j] = with_bias(v[j], gate_b, slot(j));
        activate_thresholded(*ks, act, n, v);
    }
    // The rule's verdict from the gate alone for neuron slot r, given what `activate` left (v), and the
    // activation a it leaves: SiLU's |a| > thr, else the pre-activation where it exceeds thr (0 but for
    // FATReLU), and 0 elsewhere.
    bool gate_rule(float v, int64_t r, float *a) const {
        if (thresholded(act)) {
            *a = v;
            return std::fabs(v) > thr;
        }
        const float g = with_bias(v, gate_b, r);
        const bool pass = g > thr;
        *a = keep_if(pass, g);
        return pass;
    }
    // h from a and the up projection u (its bias added); whether the neuron passes the full rule.
    bool finish(bool first_pass, float a, float u, float *h) const {
        if (act == Activation::DRelu) {
            *h = a * std::max(u, 0.0f);
            return *h > 0.0f;
        }
        *h = a * u;
        return first_pass;
    }
};

}  // namespace pi
