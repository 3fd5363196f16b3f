import { describe, expect, it } from "vitest";
import { fmt, fmtCount, fmtParams, fmtStats } from "../shared/format.js";

describe("one number format", () => {
  it("4 significant digits, thousands separators, short exponents", () => {
    expect(fmt(0.9148274183273315)).toBe("0.9148");
    expect(fmt(1234567)).toBe("1,234,567");
    expect(fmt(12345.678)).toBe("12,350");
    expect(fmt(-0.000012346)).toBe("-1.235e-5");
    expect(fmt(1.5e-7)).toBe("1.5e-7");
    expect(fmt(3e12)).toBe("3e12");
    expect(fmt(0)).toBe("0");
    expect(fmt("nan")).toBe("nan");
    expect(fmt(null)).toBe("–");
  });

  it("counts as k / M / G", () => {
    expect(fmtCount(7357000)).toBe("7.36 M");
    expect(fmtParams(7357000)).toBe("7.36 M params");
    expect(fmtParams(12)).toBe("12 params");
    expect(fmtParams(0)).toBe("");
    expect(fmtCount(950)).toBe("950");
  });

  it("full-tensor statistics with NaN/Inf counts", () => {
    expect(fmtStats({ min: -1, max: 1000, mean: 0.25, std: 2, norm: 3, nan: 1, inf: 0 }))
      .toBe("min -1 · max 1,000 · mean 0.25 · std 2 · ‖·‖₂ = 3 · 1 NaN");
  });
});
