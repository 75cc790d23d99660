// What this package uses of Node's own modules (Node 20), declared here:
// the package has no dependencies, @types/node included.
declare module "node:fs/promises" {
  export function readFile(path: string, encoding: "utf8"): Promise<string>;
}
declare const process: {
  env: Record<string, string | undefined>;
};
