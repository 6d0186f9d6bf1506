// Parses PromQL expressions with Prometheus' own Lezer grammar (@prometheus-io/lezer-promql).
// stdin: a JSON list of expressions. stdout: a JSON list, one entry per expression:
// {"errors": [offsets of syntax errors], "metrics": [metric names of its vector selectors]}.
"use strict";
const { parser } = require("@prometheus-io/lezer-promql");

const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = input.map((expr) => {
  const tree = parser.parse(expr);
  const errors = [];
  const metrics = [];
  tree.iterate({
    enter(node) {
      if (node.type.isError) errors.push(node.from);
      if (node.name === "Identifier" && node.node.parent && node.node.parent.name === "VectorSelector") {
        metrics.push(expr.slice(node.from, node.to));
      }
    },
  });
  return { errors, metrics };
});
process.stdout.write(JSON.stringify(out));
