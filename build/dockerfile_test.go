package build

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// instruction is one Dockerfile instruction with continuations joined.
type instruction struct {
	cmd  string // upper case: FROM, RUN, COPY, ...
	args string
	line int
}

// stage is one FROM ... [AS name] section.
type stage struct {
	base, name string
	instrs     []instruction
}

// parseDockerfile splits a Dockerfile into stages (enough of the syntax for
// this repository's Dockerfile: comments, backslash continuations, FROM AS).
func parseDockerfile(t *testing.T, path string) []stage {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var stages []stage
	var cur strings.Builder
	start := 0
	flush := func() {
		s := strings.TrimSpace(cur.String())
		cur.Reset()
		if s == "" {
			return
		}
		cmd, args, _ := strings.Cut(s, " ")
		in := instruction{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args), line: start}
		if in.cmd == "FROM" {
			f := strings.Fields(in.args)
			st := stage{base: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				st.name = f[2]
			}
			stages = append(stages, st)
			return
		}
		require.NotEmpty(t, stages, "%s:%d: %s before FROM", path, in.line, in.cmd)
		stages[len(stages)-1].instrs = append(stages[len(stages)-1].instrs, in)
	}
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		n++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue // comments (also inside continuations)
		}
		if cur.Len() == 0 {
			if trimmed == "" {
				continue
			}
			start = n
		}
		if strings.HasSuffix(trimmed, `\`) {
			cur.WriteString(strings.TrimSuffix(trimmed, `\`) + " ")
			continue
		}
		cur.WriteString(trimmed)
		flush()
	}
	require.NoError(t, sc.Err())
	flush()
	return stages
}

// makeBuildRecipe returns the commands of the Makefile's build target.
func makeBuildRecipe(t *testing.T, root string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "Makefile"))
	require.NoError(t, err)
	var recipe []string
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		switch {
		case strings.HasPrefix(l, "build:"):
			in = true
		case in && strings.HasPrefix(l, "\t"):
			recipe = append(recipe, strings.TrimSpace(l))
		case in:
			return recipe
		}
	}
	return recipe
}

func TestBuildStageRunsMakeBuild(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	stages := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	require.Len(t, stages, 2, "multi-stage: build and runtime")
	build := stages[0]
	assert.Equal(t, "build", build.name)
	assert.Regexp(t, `^golang:1\.26(\.\d+)?-bookworm$`, build.base, "build stage uses the project's Go version")

	// The Go version of the build image is the one go.mod asks for.
	gomod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	require.NotNil(t, m, "go directive in go.mod")
	assert.True(t, strings.HasPrefix(build.base, "golang:"+string(m[1])), "build image %s vs go.mod go %s", build.base, m[1])

	// The image builds with `make build`, nothing else: the Makefile stays
	// the one place that says how binaries are built.
	var runs []string
	for _, in := range build.instrs {
		if in.cmd == "RUN" {
			runs = append(runs, in.args)
		}
	}
	makeRuns := 0
	for _, r := range runs {
		if regexp.MustCompile(`(^|&&\s*)make build( |$)`).MatchString(r) {
			makeRuns++
		}
		assert.NotContains(t, r, "go build", "the build stage builds with make build, not its own go build")
	}
	assert.Equal(t, 1, makeRuns, "exactly one RUN make build in the build stage; RUNs: %q", runs)
	recipe := makeBuildRecipe(t, root)
	require.NotEmpty(t, recipe, "Makefile has a build target")
	assert.Contains(t, strings.Join(recipe, "\n"), "./cmd/...", "make build builds every cmd/*")
	assert.Contains(t, strings.Join(recipe, "\n"), "-o $(BIN)/", "make build writes into $(BIN)")
}

func TestRuntimeStageCopiesEveryBinary(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	stages := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	require.Len(t, stages, 2)
	runtime := stages[1]
	assert.Equal(t, "debian:bookworm-slim", runtime.base)

	// make build writes bin/<dir> for each cmd/<dir> with a main package.
	entries, err := os.ReadDir(filepath.Join(root, "cmd"))
	require.NoError(t, err)
	var want []string
	for _, e := range entries {
		// kubectl plugins (kubectl-exs) run on the users' machines, not
		// in the image.
		if e.IsDir() && !strings.HasPrefix(e.Name(), "kubectl-") {
			want = append(want, e.Name())
		}
	}
	require.Contains(t, want, "qemu-kubelet")
	require.Contains(t, want, "exporterset-controller")

	var copied []string
	for _, in := range runtime.instrs {
		if in.cmd != "COPY" {
			continue
		}
		f := strings.Fields(in.args)
		require.Equal(t, "--from=build", f[0], "line %d: runtime COPY takes build outputs", in.line)
		require.GreaterOrEqual(t, len(f), 3)
		assert.Equal(t, "/usr/local/bin/", f[len(f)-1], "line %d", in.line)
		for _, src := range f[1 : len(f)-1] {
			dir, name := filepath.Split(src)
			assert.Equal(t, "/src/bin/", dir, "line %d: %s is a make build output (WORKDIR /src, BIN=bin)", in.line, src)
			copied = append(copied, name)
		}
	}
	sort.Strings(want)
	sort.Strings(copied)
	assert.Equal(t, want, copied, "the runtime image holds exactly the binaries make build writes")

	// The chart runs them by these paths.
	for _, b := range want {
		chart, err := os.ReadFile(filepath.Join(root, "charts", "qemu-kubelet", "templates", map[string]string{
			"qemu-kubelet": "node-agent.yaml", "exporterset-controller": "controller.yaml",
		}[b]))
		require.NoError(t, err)
		assert.Contains(t, string(chart), "command: [/usr/local/bin/"+b+"]")
	}

	// The image default user is not root (the controller runs as it).
	var user string
	for _, in := range runtime.instrs {
		if in.cmd == "USER" {
			user = in.args
		}
	}
	require.NotEmpty(t, user, "runtime stage sets USER")
	uid, _, _ := strings.Cut(user, ":")
	n, err := strconv.Atoi(uid)
	require.NoError(t, err, "USER is numeric (runAsNonRoot can verify it)")
	assert.NotZero(t, n)
}

// toolPackages maps each executable the node agent runs to its Debian
// package. A new exec of a tool missing here fails TestRuntimePackages.
var toolPackages = map[string]string{
	"qemu-system-x86_64": "qemu-system-x86",
	"qemu-img":           "qemu-utils",
	"mkfs.vfat":          "dosfstools",
	"mmd":                "mtools",
	"mcopy":              "mtools",
}

// execdTools finds the executables named by string literals in exec calls
// (exec.Command, exec.CommandContext, exec.LookPath and the runTool/mt
// helpers of qemu/) and by *Binary string constants, in the non-test Go
// files of dirs.
func execdTools(t *testing.T, root string, dirs ...string) map[string]string {
	t.Helper()
	tools := map[string]string{}
	// callee name -> index of the argument naming the executable.
	callees := map[string]int{"Command": 0, "CommandContext": 1, "LookPath": 0, "runTool": 1, "mt": 0}
	fset := token.NewFileSet()
	for _, d := range dirs {
		files, err := filepath.Glob(filepath.Join(root, d, "*.go"))
		require.NoError(t, err)
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			af, err := parser.ParseFile(fset, f, nil, 0)
			require.NoError(t, err)
			lit := func(e ast.Expr) (string, bool) {
				bl, ok := e.(*ast.BasicLit)
				if !ok || bl.Kind != token.STRING {
					return "", false
				}
				s, err := strconv.Unquote(bl.Value)
				return s, err == nil
			}
			ast.Inspect(af, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.CallExpr:
					var name string
					switch fn := n.Fun.(type) {
					case *ast.Ident:
						name = fn.Name
					case *ast.SelectorExpr:
						name = fn.Sel.Name
					}
					i, ok := callees[name]
					if !ok || i >= len(n.Args) {
						return true
					}
					if s, ok := lit(n.Args[i]); ok {
						tools[s] = fset.Position(n.Args[i].Pos()).String()
					}
				case *ast.ValueSpec:
					for i, id := range n.Names {
						if strings.HasSuffix(id.Name, "Binary") && i < len(n.Values) {
							if s, ok := lit(n.Values[i]); ok {
								tools[s] = fset.Position(id.Pos()).String()
							}
						}
					}
				}
				return true
			})
		}
	}
	return tools
}

// installDepsPackages reads the PKGS list of hack/install-deps.sh.
func installDepsPackages(t *testing.T, root string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "hack", "install-deps.sh"))
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^PKGS=\(([^)]*)\)`).FindSubmatch(b)
	require.NotNil(t, m, "PKGS=(...) in hack/install-deps.sh")
	return strings.Fields(string(m[1]))
}

// aptInstalled returns the packages of `apt-get install` in a RUN.
func aptInstalled(runs []instruction) []string {
	var pkgs []string
	for _, r := range runs {
		for _, part := range strings.Split(r.args, "&&") {
			f := strings.Fields(part)
			i := slices.Index(f, "install")
			if i < 0 || !slices.Contains(f[:i], "apt-get") {
				continue
			}
			for _, w := range f[i+1:] {
				if !strings.HasPrefix(w, "-") {
					pkgs = append(pkgs, w)
				}
			}
		}
	}
	return pkgs
}

func TestRuntimePackages(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	stages := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	require.Len(t, stages, 2)
	var runs []instruction
	for _, in := range stages[1].instrs {
		if in.cmd == "RUN" {
			runs = append(runs, in)
		}
	}
	image := aptInstalled(runs)
	require.NotEmpty(t, image, "runtime stage installs Debian packages")
	for _, p := range []string{"qemu-system-x86", "qemu-utils", "ca-certificates"} {
		assert.Contains(t, image, p)
	}

	// Every tool the node agent executes is known and its package is in
	// the image.
	tools := execdTools(t, root, "qemu", "provider", "oci", "cmd/qemu-kubelet", "provider/config")
	require.Contains(t, tools, "qemu-img", "the scan finds qemu/'s tools")
	require.Contains(t, tools, "mkfs.vfat", "the scan finds qemu/'s tools")
	for tool, where := range tools {
		pkg, ok := toolPackages[tool]
		if !assert.True(t, ok, "%s: the node agent runs %q: add it and its Debian package to toolPackages and the Dockerfile", where, tool) {
			continue
		}
		assert.Contains(t, image, pkg, "%s runs %q from package %s, which the runtime image lacks", where, tool, pkg)
	}

	// The runtime subset of hack/install-deps.sh (what the tests install
	// for the same tools) is in the image too, so the two lists agree.
	deps := installDepsPackages(t, root)
	for _, pkg := range toolPackages {
		assert.Contains(t, deps, pkg, "hack/install-deps.sh lacks runtime package %s", pkg)
		assert.Contains(t, image, pkg, "runtime image lacks %s (in hack/install-deps.sh)", pkg)
	}
}

// TestParseDockerfile covers the parser on a small Dockerfile.
func TestParseDockerfile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "Dockerfile")
	require.NoError(t, os.WriteFile(p, []byte(`# c
FROM golang:1.26 AS b
RUN a \
  # inner comment
  && make build X=1
FROM debian
RUN apt-get update && apt-get install -y --no-install-recommends \
   one two \
 && rm -rf x
COPY --from=b /src/bin/x /usr/local/bin/
`), 0o600))
	st := parseDockerfile(t, p)
	require.Len(t, st, 2)
	assert.Equal(t, "b", st[0].name)
	assert.Equal(t, "RUN", st[0].instrs[0].cmd)
	assert.Contains(t, st[0].instrs[0].args, "&& make build X=1")
	assert.Equal(t, "", st[1].name)
	assert.Equal(t, []string{"one", "two"}, aptInstalled(st[1].instrs[:1]))
	assert.Equal(t, "COPY", st[1].instrs[1].cmd)
}

// TestImageScriptBuildsRuntimeStage: hack/build-image.sh (make image) builds
// the Dockerfile's runtime stage as written, only its COPY --from=build taking
// make build's outputs from the build context's bin/. So its package list,
// user and entrypoint are the Dockerfile's and cannot drift from it.
func TestImageScriptBuildsRuntimeStage(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	stages := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	require.Len(t, stages, 2)
	runtime := stages[1]

	cmd := exec.Command(filepath.Join(root, "hack", "build-image.sh"), "--print-containerfile")
	out, err := cmd.Output()
	require.NoError(t, err, "hack/build-image.sh --print-containerfile")
	p := filepath.Join(t.TempDir(), "Containerfile")
	require.NoError(t, os.WriteFile(p, out, 0o600))
	built := parseDockerfile(t, p)
	require.Len(t, built, 1, "the script builds one stage:\n%s", out)
	assert.Equal(t, runtime.base, built[0].base)
	assert.Equal(t, aptInstalled(runtime.instrs), aptInstalled(built[0].instrs), "the image's packages are the Dockerfile's")
	require.Len(t, built[0].instrs, len(runtime.instrs))
	copies := 0
	for i, in := range runtime.instrs {
		got := built[0].instrs[i]
		assert.Equal(t, in.cmd, got.cmd, "instruction %d", i)
		if in.cmd != "COPY" {
			assert.Equal(t, in.args, got.args, "Dockerfile line %d is built as written", in.line)
			continue
		}
		copies++
		// COPY --from=build /src/bin/a /src/bin/b DEST -> COPY bin/a bin/b DEST
		want := strings.ReplaceAll(strings.TrimPrefix(in.args, "--from=build "), "/src/bin/", "bin/")
		assert.Equal(t, want, got.args, "Dockerfile line %d", in.line)
	}
	assert.Equal(t, 1, copies)

	// make image = make build, then the script on make build's output.
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^image: .*\bbuild\b.*\n\t@?hack/build-image\.sh .*\$\(BIN\)$`, string(mk))

	// The script's tools are installed with the test dependencies.
	deps := installDepsPackages(t, root)
	for _, p := range []string{"buildah", "runc", "debootstrap", "umoci"} {
		assert.Contains(t, deps, p, "hack/install-deps.sh lacks %s (make image and its test need it)", p)
	}
}

// TestImageScriptRejectsOtherCopies: a runtime stage copying anything but
// make build's outputs from the build stage is refused, not half built.
func TestImageScriptRejectsOtherCopies(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "hack"), 0o755))
	script, err := os.ReadFile(filepath.Join(root, "hack", "build-image.sh"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hack", "build-image.sh"), script, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(`FROM golang:1.26-bookworm AS build
RUN make build
FROM debian:bookworm-slim
COPY --from=build /go/pkg/mod /cache
`), 0o600))
	cmd := exec.Command(filepath.Join(dir, "hack", "build-image.sh"), "--print-containerfile")
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "output: %s", out)
	assert.Contains(t, string(out), "may only COPY --from=build /src/bin/")
}

// TestProvisionerEntrypoint: the runtime stage has /exporter-set-controller,
// the path Jumpstarter's operator runs a provisioner's image by, and it is
// the exporterset-controller binary the stage copies.
func TestProvisionerEntrypoint(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	stages := parseDockerfile(t, filepath.Join(root, "Dockerfile"))
	require.Len(t, stages, 2)
	var copied, linked bool
	for _, in := range stages[1].instrs {
		f := strings.Fields(in.args)
		switch {
		case in.cmd == "COPY" && slices.Contains(f, "/src/bin/exporterset-controller") && f[len(f)-1] == "/usr/local/bin/":
			copied = true
		case in.cmd == "RUN" && copied && slices.Equal(f, []string{"ln", "-s", "/usr/local/bin/exporterset-controller", "/exporter-set-controller"}):
			linked = true
		}
	}
	assert.True(t, copied, "the runtime stage copies exporterset-controller to /usr/local/bin/")
	assert.True(t, linked, "after the copy, RUN ln -s /usr/local/bin/exporterset-controller /exporter-set-controller")
}
