// A small JSON-schema validator for the tests: the keywords hookwidget/views/payload_schema.json uses, and no
// others (an unknown keyword throws, so a schema that outgrows it cannot pass here unchecked). Python checks the
// same file with the jsonschema package (tests/test_payload_schema.py).
import SPEC from "../../hookwidget/views/payload_schema.json";

export { SPEC };
const NOTES = new Set(["description", "title", "$schema", "$id", "$defs", "x-messages"]);

const TYPES = {
  object: (v) => v !== null && typeof v === "object" && !Array.isArray(v),
  array: Array.isArray,
  string: (v) => typeof v === "string",
  number: (v) => typeof v === "number" && Number.isFinite(v), // NaN and ±Inf travel as strings
  integer: (v) => Number.isInteger(v),
  boolean: (v) => typeof v === "boolean",
  null: (v) => v === null,
};

/** The errors of `value` against $defs[name] ([] when it follows the schema), each with its path. */
export function errorsOf(name, value) {
  const out = [];
  check({ $ref: `#/$defs/${name}` }, value, "$", out);
  return out;
}

function check(schema, v, path, out) {
  for (const [key, arg] of Object.entries(schema)) {
    if (NOTES.has(key)) continue;
    const fail = (why) => out.push(`${path}: ${why}`);
    switch (key) {
      case "$ref": {
        const m = /^#\/\$defs\/(\w+)$/.exec(arg);
        if (!m || !SPEC.$defs[m[1]]) throw new Error(`unknown $ref ${arg}`);
        check(SPEC.$defs[m[1]], v, path, out);
        break;
      }
      case "type": if (![arg].flat().some((t) => TYPES[t](v))) fail(`not ${arg}: ${JSON.stringify(v)}`.slice(0, 200)); break;
      case "enum": if (!arg.includes(v)) fail(`${JSON.stringify(v)} not one of ${arg.join(", ")}`); break;
      case "const": if (v !== arg) fail(`${JSON.stringify(v)} is not ${JSON.stringify(arg)}`); break;
      case "minimum": if (typeof v === "number" && v < arg) fail(`${v} < ${arg}`); break;
      case "minLength": if (typeof v === "string" && v.length < arg) fail(`shorter than ${arg}`); break;
      case "maxLength": if (typeof v === "string" && v.length > arg) fail(`longer than ${arg}`); break;
      case "minItems": if (Array.isArray(v) && v.length < arg) fail(`fewer than ${arg} items`); break;
      case "maxItems": if (Array.isArray(v) && v.length > arg) fail(`more than ${arg} items`); break;
      case "items": if (Array.isArray(v)) v.forEach((x, i) => check(arg, x, `${path}[${i}]`, out)); break;
      case "required": if (TYPES.object(v)) for (const k of arg) if (!(k in v)) fail(`missing ${k}`); break;
      case "properties": if (TYPES.object(v)) for (const [k, s] of Object.entries(arg)) if (k in v) check(s, v[k], `${path}.${k}`, out); break;
      case "additionalProperties":
        if (TYPES.object(v)) {
          for (const [k, x] of Object.entries(v)) {
            if (schema.properties && k in schema.properties) continue;
            if (arg === false) fail(`unknown key ${k}`);
            else check(arg, x, `${path}.${k}`, out);
          }
        }
        break;
      case "anyOf": {
        const tries = arg.map((s) => { const e = []; check(s, v, path, e); return e; });
        if (!tries.some((e) => e.length === 0)) fail(`matches none of anyOf: ${tries.map((e) => e[0]).join(" | ")}`);
        break;
      }
      default: throw new Error(`payload_schema.json uses ${key}, which js/tests/schema.js does not check`);
    }
  }
}
