// A large weight's detail (views/payload/grads.py): Σ δ⊗a pictured from the factors, without whole-tensor statistics,
// and the check along random directions shown with what it was measured along; both as the schema describes them.
import { beforeEach, describe, expect, it } from "vitest";
import { detailReply, mount, tick } from "./fake_model.js";
import { errorsOf } from "./schema.js";

beforeEach(() => { document.body.replaceChildren(); });

function largeReply(target, request_id, agree) {
  const [msg, buffers] = detailReply(target, request_id);
  const meta = { ...msg.meta, tensors: { ...msg.meta.tensors } };
  delete meta.max_abs_diff;
  meta.tensors.grad_rebuilt = { dtype: "float32", shape: [1, 2], true_shape: [50257, 768], layout: "matrix",
    min: -1, max: 0.5, nonfinite: 0, buffer: 0, stats: null };
  meta.grad_check = { directions: 2, values: [-1.4665, -1.1017], differences: [4.8e-6, agree ? 9.6e-6 : 0.86],
    tolerances: [0.29, 0.28], agree, layers: [target, "transformer.wte"] };
  return [{ ...msg, meta }, buffers];
}

describe("a large weight's detail", () => {
  for (const agree of [true, false]) {
    it(`names the directions the check was measured along (${agree ? "agree" : "differ"})`, async () => {
      const { model, el } = mount();
      el.querySelector('[data-module="fc1"]').dispatchEvent(new Event("click"));
      const reply = largeReply("fc1", model.sent.at(-1).request_id, agree);
      expect(errorsOf("reply_detail", reply[0])).toEqual([]);
      model.emit("msg:custom", ...reply);
      await tick();
      const check = el.querySelector('[data-testid="grad-check"]');
      expect(check.getAttribute("data-agree")).toBe(String(agree));
      expect(check.textContent).toContain("W.grad vs Σ δ⊗a (fc1 + transformer.wte) along 2 random directions u, v");
      expect(check.querySelector("b").textContent).toBe(agree ? "agree" : "differ");
      expect([...check.querySelectorAll("li")].map((li) => li.textContent)[1])
        .toBe(`uᵀ W.grad v = -1.102, |uᵀ(W.grad − Σ δ⊗a)v| = ${agree ? "9.6e-6" : "0.86"} (tolerance 0.28)`);
      expect(el.querySelector('[data-testid="maxdiff"]')).toBeNull();
      const fig = el.querySelector('[data-testid="heat-grad-rebuilt"]').closest("figure");
      expect(fig.querySelector("figcaption").textContent).toContain("Σ δ⊗a (block means from the factors)");
      expect(el.querySelector('[data-testid="heat-grad-rebuilt-stats"]').textContent).toBe("picture range [-1, 0.5]");
    });
  }
});
