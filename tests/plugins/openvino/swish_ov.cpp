// kiln.examples::Swish (y = x * sigmoid(beta * x)) as an OpenVINO extension: the op the example
// swish plugin implements for onnxruntime, so the onnxruntime reference verifies this kernel.
// One translation unit, built by tests/plugins/test_openvino.py against the openvino wheel's
// headers and libopenvino; Core.add_extension loads it.
#include <cmath>
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>
#include <openvino/op/op.hpp>

namespace kiln {

class Swish : public ov::op::Op {
public:
    OPENVINO_OP("Swish", "kiln_examples");

    Swish() = default;
    Swish(const ov::Output<ov::Node>& x, float beta) : Op({x}), m_beta(beta) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32,
                              "kiln.examples::Swish takes float32, got ",
                              get_input_element_type(0));
        set_output_type(0, get_input_element_type(0), get_input_partial_shape(0));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<Swish>(args.at(0), m_beta);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("beta", m_beta);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto& x = inputs.at(0);
        auto& y = outputs.at(0);
        y.set_shape(x.get_shape());
        const float* in = x.data<const float>();
        float* out = y.data<float>();
        const size_t n = x.get_size();
        for (size_t i = 0; i < n; ++i) {
            out[i] = in[i] / (1.0f + std::exp(-m_beta * in[i]));
        }
        return true;
    }

private:
    float m_beta = 1.0f;
};

}  // namespace kiln

// The op itself (what an exported blob names, rebuilt on import from the Core's extensions), and
// the ONNX front end's rule: node kiln.examples::Swish becomes it, attribute beta by name.
OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<kiln::Swish>>(),
    std::make_shared<ov::frontend::onnx::OpExtension<kiln::Swish>>("Swish", "kiln.examples"),
}));
