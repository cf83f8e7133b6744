package deploy

// These tests hold the deploy material to the binary it deploys:
//
//   - TestDockerBuild: the Dockerfile's go build works on the context
//     .dockerignore leaves, and gives a static binary (what distroless/static
//     needs). Every other test uses that binary.
//   - TestManifests: every manifest (the kustomize base and the rendered
//     example overlay) decodes strictly into k8s.io/api types; every flag and
//     QUOTAD_* variable passed to quotad is in `quotad serve --help`; probes,
//     ports and Services agree with the addresses quotad is given; the grace
//     period covers preStop + drain + settle.
//   - TestServeTakesManifestSettings: quotad serve starts with the manifests'
//     settings, answers the probe paths on the admin port, and exits 0 on
//     SIGTERM.
//
// observability_test.go checks the alert rules and the dashboard against
// metrics.txt; local_test.go runs deploy/local/cluster.sh.

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/quotaring/quotaring/internal/logbuf"
)

// repoRoot is the module root, one level up from this package.
const repoRoot = ".."

// serveShutdownMargin is what quotad serve adds to --drain-timeout +
// --settle-timeout to bound its whole shutdown (runServe in
// cmd/quotad/serve.go: handing reservations back, leaving the ring), plus the
// 5 s the ring's Close may take after it and the 2 s the ledger's Close may
// wait for its connections (flush's closeWait). The grace period must cover
// it too.
const serveShutdownMargin = 17 * time.Second

// ---------------------------------------------------------------- the binary

// quotadBin is built once per test process by TestDockerBuild's command (see
// buildQuotad) and shared by the tests that run it.
type builtBinary struct {
	once sync.Once
	path string
	err  error
}

var quotadBin builtBinary

func TestMain(m *testing.M) {
	code := m.Run()
	if quotadBin.path != "" {
		os.RemoveAll(filepath.Dir(quotadBin.path))
	}
	os.Exit(code)
}

// dockerBuildCmd is the go build the Dockerfile runs, as the test expects to
// find it there (TestDockerBuild fails when the two drift apart). The test's
// build gives ${VERSION} the value dockerTestVersion.
var dockerBuildCmd = []string{"go", "build", "-trimpath", "-ldflags", "-s -w -X github.com/quotaring/quotaring/internal/buildinfo.version=${VERSION}", "-o", "/out/quotad", "./cmd/quotad"}

// dockerTestVersion is the VERSION build argument of the test's build.
const dockerTestVersion = "v0.0.0-deploytest"

// buildQuotad builds quotad the way the Dockerfile does: the files
// .dockerignore leaves, CGO_ENABLED=0, the Dockerfile's flags.
func buildQuotad(t *testing.T) string {
	t.Helper()
	quotadBin.once.Do(func() {
		quotadBin.path, quotadBin.err = dockerLikeBuild()
	})
	if quotadBin.err != nil {
		t.Fatalf("building quotad as the Dockerfile does: %v", quotadBin.err)
	}
	return quotadBin.path
}

func dockerLikeBuild() (string, error) {
	out, err := os.MkdirTemp("", "quotaring-deploy-bin-")
	if err != nil {
		return "", err
	}
	ctxDir := filepath.Join(out, "context")
	ignore, err := readDockerignore(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		return "", err
	}
	if err := copyContext(repoRoot, ctxDir, ignore); err != nil {
		return "", fmt.Errorf("copy the build context: %w", err)
	}
	bin := filepath.Join(out, "quotad")
	args := slices.Clone(dockerBuildCmd[1:])
	args[slices.Index(args, "-o")+1] = bin
	for i := range args {
		args[i] = strings.ReplaceAll(args[i], "${VERSION}", dockerTestVersion)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = ctxDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("CGO_ENABLED=0 go %s in the .dockerignore'd context: %v\n%s", strings.Join(args, " "), err, b)
	}
	os.RemoveAll(ctxDir)
	return bin, nil
}

// ---------------------------------------------------------------- .dockerignore

type ignoreRule struct {
	re      *regexp.Regexp
	exclude bool // false for a "!pattern" exception
}

// readDockerignore reads the patterns as Docker does (moby/patternmatcher):
// relative to the context root, a leading / ignored, * and ? within one path
// element, ** across elements; a pattern that matches a directory excludes
// what is under it; a later !pattern re-includes.
func readDockerignore(path string) ([]ignoreRule, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rules []ignoreRule
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		r := ignoreRule{exclude: true}
		if strings.HasPrefix(line, "!") {
			r.exclude = false
			line = strings.TrimSpace(line[1:])
		}
		line = strings.TrimPrefix(filepath.ToSlash(filepath.Clean(line)), "/")
		var re strings.Builder
		re.WriteString("^")
		for i := 0; i < len(line); i++ {
			switch c := line[i]; {
			case c == '*' && i+1 < len(line) && line[i+1] == '*':
				i++
				if i+1 < len(line) && line[i+1] == '/' {
					i++
					re.WriteString("(.*/)?")
				} else {
					re.WriteString(".*")
				}
			case c == '*':
				re.WriteString("[^/]*")
			case c == '?':
				re.WriteString("[^/]")
			default:
				re.WriteString(regexp.QuoteMeta(string(c)))
			}
		}
		re.WriteString("(/.*)?$")
		rx, err := regexp.Compile(re.String())
		if err != nil {
			return nil, fmt.Errorf(".dockerignore pattern %q: %v", line, err)
		}
		r.re = rx
		rules = append(rules, r)
	}
	return rules, nil
}

func ignored(rules []ignoreRule, rel string) bool {
	ex := false
	for _, r := range rules {
		if r.re.MatchString(rel) {
			ex = r.exclude
		}
	}
	return ex
}

func copyContext(src, dst string, rules []ignoreRule) error {
	hasExceptions := slices.ContainsFunc(rules, func(r ignoreRule) bool { return !r.exclude })
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		rel = filepath.ToSlash(rel)
		if rel == "." {
			return os.MkdirAll(dst, 0o755)
		}
		if ignored(rules, rel) {
			if d.IsDir() && !hasExceptions {
				return filepath.SkipDir
			}
			return nil
		}
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case d.Type().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(target, b, 0o644)
		}
		return nil // symlinks, sockets: not part of a Go build
	})
}

// ---------------------------------------------------------------- flags

// flagInfo is one flag of `quotad serve --help`.
type flagInfo struct {
	name, typ, def string
}

var helpFlagLine = regexp.MustCompile(`^\s+(?:-\w, )?--([a-z0-9][a-z0-9-]*)(?: (\w+))?\s{2,}(.*)$`)
var helpDefault = regexp.MustCompile(`\(default (.*)\)$`)

// serveFlags parses `quotad serve --help`.
func serveFlags(t *testing.T, bin string) map[string]flagInfo {
	t.Helper()
	flags, out := commandFlags(t, bin, "serve")
	for _, want := range []string{"node-id", "data-dir", "ledger", "admin-addr", "drain-timeout", "settle-timeout"} {
		if _, ok := flags[want]; !ok {
			t.Fatalf("quotad serve --help lists no --%s: has the help format changed? got flags %v\n%s", want, keys(flags), out)
		}
	}
	return flags
}

// commandFlags parses `quotad COMMAND --help`: its flags and the help text.
func commandFlags(t *testing.T, bin, command string) (map[string]flagInfo, []byte) {
	t.Helper()
	cmd := exec.Command(bin, command, "--help")
	cmd.Env = cleanEnv()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("quotad %s --help: %v\n%s", command, err, out)
	}
	flags := map[string]flagInfo{}
	inFlags := false
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasSuffix(line, "Flags:") {
			inFlags = true
			continue
		}
		if !inFlags {
			continue
		}
		m := helpFlagLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		f := flagInfo{name: m[1], typ: m[2]}
		if f.typ == "" {
			f.typ = "bool"
		}
		if d := helpDefault.FindStringSubmatch(m[3]); d != nil {
			f.def = d[1]
			if u, err := strconv.Unquote(f.def); err == nil {
				f.def = u
			}
		} else if f.typ == "bool" {
			f.def = "false"
		}
		flags[f.name] = f
	}
	return flags, out
}

// flagOfEnv maps QUOTAD_DATA_DIR to data-dir (cmd/quotad's bindEnv, reversed),
// and a secret's file twin, QUOTAD_GOSSIP_KEY_FILE, to gossip-key (the file
// holds the flag's value: cmd/quotad's lookupEnv).
func flagOfEnv(env string) (string, bool) {
	rest, ok := strings.CutPrefix(env, "QUOTAD_")
	if !ok || rest == "" {
		return "", false
	}
	flag := strings.ToLower(strings.ReplaceAll(rest, "_", "-"))
	if secret, ok := strings.CutSuffix(flag, "-file"); ok && secretFileFlags[secret] {
		return secret, true
	}
	return flag, true
}

// secretFileFlags are the flags whose QUOTAD_<FLAG>_FILE names a file
// holding the value (cmd/quotad's secretFlags).
var secretFileFlags = map[string]bool{"admin-token": true, "rpc-token": true, "gossip-key": true, "alert-secret": true, "ledger": true}

// cleanEnv is the environment for running quotad in tests: no QUOTAD_* from
// the caller's shell.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "QUOTAD_") {
			env = append(env, kv)
		}
	}
	return env
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// ---------------------------------------------------------------- rendering

// kustomization is the part of kustomization.yaml these manifests use,
// decoded strictly so that a misspelt field fails here rather than being
// ignored. Add fields as the manifests start to use them.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace,omitempty"`
	Resources  []string `json:"resources,omitempty"`
	Replicas   []struct {
		Name  string `json:"name"`
		Count int    `json:"count"`
	} `json:"replicas,omitempty"`
	Images []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
		Digest  string `json:"digest,omitempty"`
	} `json:"images,omitempty"`
	GeneratorOptions *struct {
		Labels                map[string]string `json:"labels,omitempty"`
		Annotations           map[string]string `json:"annotations,omitempty"`
		DisableNameSuffixHash bool              `json:"disableNameSuffixHash,omitempty"`
	} `json:"generatorOptions,omitempty"`
	ConfigMapGenerator []generator `json:"configMapGenerator,omitempty"`
	SecretGenerator    []generator `json:"secretGenerator,omitempty"`
	Patches            []struct {
		Path   string `json:"path,omitempty"`
		Patch  string `json:"patch,omitempty"`
		Target *struct {
			Group   string `json:"group,omitempty"`
			Version string `json:"version,omitempty"`
			Kind    string `json:"kind,omitempty"`
			Name    string `json:"name,omitempty"`
		} `json:"target,omitempty"`
	} `json:"patches,omitempty"`
}

type generator struct {
	Name     string   `json:"name"`
	Behavior string   `json:"behavior,omitempty"`
	Envs     []string `json:"envs,omitempty"`
	Literals []string `json:"literals,omitempty"`
	Files    []string `json:"files,omitempty"`
	Type     string   `json:"type,omitempty"`
}

// manifests is one rendering: every object by kind.
type manifests struct {
	source       string
	statefulSets []*appsv1.StatefulSet
	services     []*corev1.Service
	configMaps   []*corev1.ConfigMap
	secrets      []*corev1.Secret
	accounts     []*corev1.ServiceAccount
	pdbs         []*policyv1.PodDisruptionBudget
	namespaces   []*corev1.Namespace
	policies     []*networkingv1.NetworkPolicy
	cronJobs     []*batchv1.CronJob
	all          []metav1.Object
}

// decodeStrict decodes one YAML document into the k8s.io/api type of its
// kind. Unknown fields and duplicate keys fail.
func decodeStrict(doc []byte, m *manifests) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return err
	}
	var obj interface {
		metav1.Object
	}
	switch tm.APIVersion + " " + tm.Kind {
	case "apps/v1 StatefulSet":
		o := &appsv1.StatefulSet{}
		m.statefulSets, obj = append(m.statefulSets, o), o
	case "v1 Service":
		o := &corev1.Service{}
		m.services, obj = append(m.services, o), o
	case "v1 ConfigMap":
		o := &corev1.ConfigMap{}
		m.configMaps, obj = append(m.configMaps, o), o
	case "v1 Secret":
		o := &corev1.Secret{}
		m.secrets, obj = append(m.secrets, o), o
	case "v1 ServiceAccount":
		o := &corev1.ServiceAccount{}
		m.accounts, obj = append(m.accounts, o), o
	case "policy/v1 PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		m.pdbs, obj = append(m.pdbs, o), o
	case "v1 Namespace":
		o := &corev1.Namespace{}
		m.namespaces, obj = append(m.namespaces, o), o
	case "networking.k8s.io/v1 NetworkPolicy":
		o := &networkingv1.NetworkPolicy{}
		m.policies, obj = append(m.policies, o), o
	case "batch/v1 CronJob":
		o := &batchv1.CronJob{}
		m.cronJobs, obj = append(m.cronJobs, o), o
	default:
		return fmt.Errorf("no k8s.io/api type for %s %s in this test: add it to decodeStrict", tm.APIVersion, tm.Kind)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return fmt.Errorf("%s %s: %w", tm.Kind, nameOf(doc), err)
	}
	m.all = append(m.all, obj)
	return nil
}

func nameOf(doc []byte) string {
	var o struct {
		Metadata struct{ Name string } `json:"metadata"`
	}
	yaml.Unmarshal(doc, &o)
	return o.Metadata.Name
}

// splitDocs splits a multi-document YAML stream on --- lines.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		if len(bytes.TrimSpace(stripComments(cur.Bytes()))) > 0 {
			docs = append(docs, slices.Clone(cur.Bytes()))
		}
		cur.Reset()
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if strings.TrimRight(sc.Text(), " \t") == "---" {
			flush()
			continue
		}
		cur.Write(sc.Bytes())
		cur.WriteByte('\n')
	}
	flush()
	return docs
}

func stripComments(b []byte) []byte {
	var out []byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(out, l...)
			out = append(out, '\n')
		}
	}
	return out
}

// kustomizeTool finds a kustomize: the standalone one, or kubectl's.
func kustomizeTool() []string {
	if p, err := exec.LookPath("kustomize"); err == nil {
		return []string{p, "build"}
	}
	if p, err := exec.LookPath("kubectl"); err == nil {
		return []string{p, "kustomize"}
	}
	return nil
}

// render runs kustomize on dir and decodes the output strictly.
func render(t *testing.T, tool []string, dir string) *manifests {
	t.Helper()
	cmd := exec.Command(tool[0], append(tool[1:], dir)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", strings.Join(tool, " "), dir, err, stderr.String())
	}
	m := &manifests{source: "rendered " + dir}
	for _, doc := range splitDocs(out) {
		if err := decodeStrict(doc, m); err != nil {
			t.Errorf("%s: %v", m.source, err)
		}
	}
	return m
}

// loadBase builds the base without kustomize: its resource files as they
// are, and the ConfigMaps and Secrets its generators would make (names
// without the hash suffix, which no reference then carries either).
func loadBase(t *testing.T, dir string) *manifests {
	t.Helper()
	k := readKustomization(t, dir)
	m := &manifests{source: "files of " + dir}
	for _, r := range k.Resources {
		b, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatalf("%s: resource %s: %v", dir, r, err)
		}
		for _, doc := range splitDocs(b) {
			if err := decodeStrict(doc, m); err != nil {
				t.Errorf("%s/%s: %v", dir, r, err)
			}
		}
	}
	for _, g := range k.ConfigMapGenerator {
		cm := &corev1.ConfigMap{Data: generatedData(t, dir, g)}
		cm.Name = g.Name
		m.configMaps = append(m.configMaps, cm)
	}
	for _, g := range k.SecretGenerator {
		s := &corev1.Secret{StringData: generatedData(t, dir, g)}
		s.Name = g.Name
		m.secrets = append(m.secrets, s)
	}
	return m
}

func generatedData(t *testing.T, dir string, g generator) map[string]string {
	t.Helper()
	data := map[string]string{}
	add := func(kv, where string) {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			t.Errorf("%s: %q is not KEY=VALUE", where, kv)
			return
		}
		data[k] = v
	}
	for _, e := range g.Envs {
		b, err := os.ReadFile(filepath.Join(dir, e))
		if err != nil {
			t.Fatalf("generator %s: %v", g.Name, err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				add(l, filepath.Join(dir, e))
			}
		}
	}
	for _, l := range g.Literals {
		add(l, "generator "+g.Name)
	}
	return data
}

func readKustomization(t *testing.T, dir string) kustomization {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(b, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", dir, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("%s/kustomization.yaml: apiVersion %q kind %q", dir, k.APIVersion, k.Kind)
	}
	return k
}

// decodeOverlayFiles decodes an overlay's own files strictly: its resources
// and its patches (a strategic-merge patch is a partial object of a known
// kind; a JSON patch is a list of operations).
func decodeOverlayFiles(t *testing.T, dir string) {
	t.Helper()
	k := readKustomization(t, dir)
	m := &manifests{source: dir}
	for _, r := range k.Resources {
		if fi, err := os.Stat(filepath.Join(dir, r)); err == nil && fi.IsDir() {
			continue // another kustomization (the base)
		}
		b, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatalf("%s: resource %s: %v", dir, r, err)
		}
		for _, doc := range splitDocs(b) {
			if err := decodeStrict(doc, m); err != nil {
				t.Errorf("%s/%s: %v", dir, r, err)
			}
		}
	}
	for _, p := range k.Patches {
		if p.Path == "" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, p.Path))
		if err != nil {
			t.Fatalf("%s: patch %s: %v", dir, p.Path, err)
		}
		if strings.HasPrefix(strings.TrimSpace(string(stripComments(b))), "- ") {
			var ops []struct {
				Op    string          `json:"op"`
				Path  string          `json:"path"`
				Value json.RawMessage `json:"value,omitempty"`
				From  string          `json:"from,omitempty"`
			}
			if err := yaml.UnmarshalStrict(b, &ops); err != nil {
				t.Errorf("%s/%s (JSON patch): %v", dir, p.Path, err)
			}
			for _, op := range ops {
				if !slices.Contains([]string{"add", "remove", "replace", "move", "copy", "test"}, op.Op) || !strings.HasPrefix(op.Path, "/") {
					t.Errorf("%s/%s: bad JSON patch operation %+v", dir, p.Path, op)
				}
			}
			continue
		}
		for _, doc := range splitDocs(b) {
			if err := decodeStrict(doc, &manifests{}); err != nil {
				t.Errorf("%s/%s (strategic-merge patch): %v", dir, p.Path, err)
			}
		}
	}
}

// ---------------------------------------------------------------- the tests

func TestDockerBuild(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	// Join continuation lines, drop comments.
	var lines []string
	var cur string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "#") {
			continue
		}
		if s, ok := strings.CutSuffix(strings.TrimRight(l, " "), "\\"); ok {
			cur += s + " "
			continue
		}
		lines = append(lines, strings.Join(strings.Fields(cur+l), " "))
		cur = ""
	}
	var froms, runs []string
	instr := map[string][]string{}
	for _, l := range lines {
		if l == "" {
			continue
		}
		word, rest, _ := strings.Cut(l, " ")
		instr[strings.ToUpper(word)] = append(instr[strings.ToUpper(word)], rest)
		switch strings.ToUpper(word) {
		case "FROM":
			froms = append(froms, rest)
		case "RUN":
			runs = append(runs, rest)
		}
	}
	if len(froms) < 2 || !strings.HasPrefix(froms[0], "golang:1.26") {
		t.Errorf("want a multi-stage build from golang:1.26; FROM lines %q", froms)
	}
	if last := froms[len(froms)-1]; !strings.Contains(last, "distroless/static") || !strings.Contains(last, "nonroot") {
		t.Errorf("final stage %q: want gcr.io/distroless/static-debian12:nonroot (or another static non-root base)", last)
	}
	wantBuild := `CGO_ENABLED=0 ` + strings.Join(dockerBuildCmd[:4], " ") + ` "` + dockerBuildCmd[4] + `" ` + strings.Join(dockerBuildCmd[5:], " ")
	if !slices.ContainsFunc(runs, func(r string) bool { return strings.Contains(r, wantBuild) }) {
		t.Errorf("no RUN in the Dockerfile contains %q, the build this test runs; keep them in step. RUN lines:\n%s", wantBuild, strings.Join(runs, "\n"))
	}
	users := instr["USER"]
	if len(users) == 0 || slices.Contains([]string{"0", "root", "0:0"}, users[len(users)-1]) {
		t.Errorf("USER %q: want a non-root user", users)
	}
	if e := instr["ENTRYPOINT"]; len(e) == 0 || !strings.Contains(e[len(e)-1], "quotad") {
		t.Errorf("ENTRYPOINT %q: want quotad", e)
	}
	if v := instr["VOLUME"]; len(v) == 0 || !strings.Contains(v[0], "/var/lib/quotad") {
		t.Errorf("VOLUME %q: want /var/lib/quotad", v)
	}
	exposed := strings.Join(instr["EXPOSE"], " ")
	for _, p := range []string{"8080", "7400", "9090", "7946/tcp", "7946/udp"} {
		if !strings.Contains(exposed, p) {
			t.Errorf("EXPOSE %q: missing %s", exposed, p)
		}
	}

	bin := buildQuotad(t)
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s has a dynamic loader: distroless/static cannot run it (is cgo on?)", bin)
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("%s links %v: want a static binary", bin, libs)
	}
	// The VERSION build argument reaches the binary (the context has no .git
	// to stamp a version from).
	if out, err := exec.Command(bin, "version", "--short").CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != dockerTestVersion {
		t.Errorf("quotad version --short of the Dockerfile's build: %q, %v; want %s (ARG VERSION through -ldflags -X)", out, err, dockerTestVersion)
	}
	flags := serveFlags(t, bin)
	for _, e := range instr["ENV"] {
		name, _, _ := strings.Cut(e, "=")
		if fl, ok := flagOfEnv(name); ok {
			if _, ok := flags[fl]; !ok {
				t.Errorf("Dockerfile ENV %s: quotad serve has no --%s", name, fl)
			}
		}
	}
}

func TestManifests(t *testing.T) {
	base := filepath.Join("kubernetes", "base")
	overlay := filepath.Join("kubernetes", "overlays", "example")
	bin := buildQuotad(t)
	flags := serveFlags(t, bin)

	// Every file, as written, decodes strictly (kustomize itself passes
	// unknown fields through), and every QUOTAD_* name the generators make
	// is a flag (also without kustomize to render the overlay).
	decodeOverlayFiles(t, overlay)
	files := loadBase(t, base)
	for _, dir := range []string{base, overlay} {
		k := readKustomization(t, dir)
		for _, g := range slices.Concat(k.ConfigMapGenerator, k.SecretGenerator) {
			for _, name := range keys(generatedData(t, dir, g)) {
				if fl, ok := flagOfEnv(name); ok {
					if _, ok := flags[fl]; !ok {
						t.Errorf("%s: generator %s makes %s: quotad serve has no --%s", dir, g.Name, name, fl)
					}
				}
			}
		}
	}

	tool := kustomizeTool()
	if tool == nil {
		if os.Getenv("QUOTARING_REQUIRE_KUSTOMIZE") == "1" {
			t.Fatal("neither kustomize nor kubectl is on PATH, and QUOTARING_REQUIRE_KUSTOMIZE=1")
		}
		t.Log("NOTE: neither kustomize nor kubectl is on PATH: checking the base's files only; the example overlay is decoded but not rendered (set QUOTARING_REQUIRE_KUSTOMIZE=1 to make this a failure)")
		t.Run("base-files", func(t *testing.T) { checkManifests(t, files, flags, nil) })
		return
	}
	t.Run("base", func(t *testing.T) {
		checkManifests(t, render(t, tool, base), flags, nil)
	})
	t.Run("overlay-example", func(t *testing.T) {
		m := render(t, tool, overlay)
		checkManifests(t, m, flags, func(t *testing.T, m *manifests, env map[string]envValue) {
			if got := *m.statefulSets[0].Spec.Replicas; got != 5 {
				t.Errorf("overlay replicas = %d, want 5", got)
			}
			if len(m.namespaces) != 1 {
				t.Fatalf("overlay: want one Namespace, got %d", len(m.namespaces))
			}
			ns := m.namespaces[0].Name
			for _, o := range m.all {
				if _, isNS := o.(*corev1.Namespace); !isNS && o.GetNamespace() != ns {
					t.Errorf("overlay: %s is in namespace %q, want %q", o.GetName(), o.GetNamespace(), ns)
				}
			}
			if v := env["QUOTAD_LEDGER"].value; strings.Contains(v, "CHANGE-ME") {
				t.Errorf("overlay: QUOTAD_LEDGER is still the base's placeholder %q", v)
			}
			t.Run("ledger-maintenance", func(t *testing.T) { checkLedgerMaintenance(t, m, bin) })
		})
	})
}

// envValue is one resolved environment variable of the quotad container.
type envValue struct {
	value  string
	from   string // "value", "configmap", "secret", "field:metadata.name", ...
	source string
}

// The values the downward API would give, for resolving $(VAR) references.
var downward = map[string]string{"metadata.name": "quotad-0", "status.podIP": "10.1.2.3", "metadata.namespace": "quotaring"}

// quotadPod is the quotad container of one rendering, and what quotad would
// make of its settings.
type quotadPod struct {
	m     *manifests
	sts   *appsv1.StatefulSet
	pod   *corev1.PodSpec
	c     *corev1.Container
	flags map[string]flagInfo
	args  map[string]string   // --flag=value arguments after serve
	env   map[string]envValue // the container's resolved environment
	ports map[string]corev1.ContainerPort
}

func newQuotadPod(t *testing.T, m *manifests, flags map[string]flagInfo) *quotadPod {
	t.Helper()
	if len(m.statefulSets) != 1 {
		t.Fatalf("%s: want one StatefulSet, got %d", m.source, len(m.statefulSets))
	}
	q := &quotadPod{m: m, sts: m.statefulSets[0], flags: flags, args: map[string]string{}, ports: map[string]corev1.ContainerPort{}}
	q.pod = &q.sts.Spec.Template.Spec
	for i := range q.pod.Containers {
		if q.pod.Containers[i].Name == "quotad" {
			q.c = &q.pod.Containers[i]
		}
	}
	if q.c == nil {
		t.Fatalf("%s: the StatefulSet has no container named quotad", m.source)
	}
	if len(q.c.Args) == 0 || q.c.Args[0] != "serve" {
		t.Fatalf("%s: args %q: want serve first", m.source, q.c.Args)
	}
	for _, a := range q.c.Args[1:] {
		name, val, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		q.args[name] = val
	}
	q.env = resolveEnv(t, m, q.c)
	for _, p := range q.c.Ports {
		q.ports[p.Name] = p
	}
	return q
}

// setting is what quotad would use for a flag: the command line, the
// environment, or the default.
func (q *quotadPod) setting(flag string) string {
	if v, ok := q.args[flag]; ok {
		return v
	}
	if v, ok := q.env["QUOTAD_"+strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))]; ok {
		return v.value
	}
	return q.flags[flag].def
}

// port resolves a named or numbered port of the container.
func (q *quotadPod) port(p intstr.IntOrString) int32 {
	if p.Type == intstr.String {
		return q.ports[p.StrVal].ContainerPort
	}
	return p.IntVal
}

// addrPort is the port number of one of quotad's address flags.
func (q *quotadPod) addrPort(t *testing.T, flag string) (host string, port int32) {
	t.Helper()
	host, p, err := net.SplitHostPort(q.setting(flag))
	if err != nil {
		t.Errorf("--%s %q: %v", flag, q.setting(flag), err)
		return "", 0
	}
	n, _ := strconv.Atoi(p)
	return host, int32(n)
}

func checkManifests(t *testing.T, m *manifests, flags map[string]flagInfo, extra func(*testing.T, *manifests, map[string]envValue)) {
	q := newQuotadPod(t, m, flags)
	t.Run("flags", func(t *testing.T) { checkFlags(t, q) })
	t.Run("state", func(t *testing.T) { checkState(t, q) })
	t.Run("ports-probes", func(t *testing.T) { checkPortsAndProbes(t, q) })
	t.Run("shutdown-budget", func(t *testing.T) { checkShutdownBudget(t, q) })
	t.Run("services", func(t *testing.T) { checkServices(t, q) })
	t.Run("security-scheduling", func(t *testing.T) { checkSecurity(t, q) })
	t.Run("network-policies", func(t *testing.T) { checkNetworkPolicies(t, q) })
	if extra != nil {
		t.Run("overlay", func(t *testing.T) { extra(t, m, q.env) })
	}
}

// checkNetworkPolicies: a NetworkPolicy that selects the quotad pods names
// ports the container has, and admits the gossip ports from the quotad pods
// only (whoever reaches them decides who owns what).
func checkNetworkPolicies(t *testing.T, q *quotadPod) {
	podLabels := labels.Set(q.sts.Spec.Template.Labels)
	for _, np := range q.m.policies {
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil {
			t.Errorf("NetworkPolicy %s: %v", np.Name, err)
			continue
		}
		if !sel.Matches(podLabels) {
			continue
		}
		for i, rule := range np.Spec.Ingress {
			gossip := false
			for _, p := range rule.Ports {
				if p.Port == nil {
					continue
				}
				if p.Port.Type == intstr.String {
					if _, ok := q.ports[p.Port.StrVal]; !ok {
						t.Errorf("NetworkPolicy %s, rule %d: port %q is not a port of the container", np.Name, i, p.Port.StrVal)
					}
				}
				if port := q.port(*p.Port); port == q.ports["gossip"].ContainerPort {
					gossip = true
				}
			}
			if len(rule.Ports) == 0 {
				gossip = true // every port
			}
			if !gossip {
				continue
			}
			for _, from := range rule.From {
				ok := from.NamespaceSelector == nil && from.IPBlock == nil && from.PodSelector != nil
				if ok {
					ps, err := metav1.LabelSelectorAsSelector(from.PodSelector)
					ok = err == nil && ps.Matches(podLabels) && !ps.Empty()
				}
				if !ok {
					t.Errorf("NetworkPolicy %s, rule %d admits the gossip port from %+v: admit it from the quotad pods only", np.Name, i, from)
				}
			}
			if len(rule.From) == 0 {
				t.Errorf("NetworkPolicy %s, rule %d admits the gossip port from anywhere", np.Name, i)
			}
		}
	}
}

// checkFlags: every flag on the command line and every QUOTAD_* variable is
// a flag of quotad serve.
func checkFlags(t *testing.T, q *quotadPod) {
	if len(q.c.Command) > 0 && !strings.HasSuffix(q.c.Command[0], "quotad") {
		t.Errorf("command %q: want quotad (or none, for the image's ENTRYPOINT)", q.c.Command)
	}
	for _, a := range q.c.Args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") {
			t.Errorf("argument %q: pass flags as --name=value", a)
		} else if _, ok := q.flags[name]; !ok {
			t.Errorf("argument %q: quotad serve has no --%s", a, name)
		}
	}
	for _, name := range keys(q.env) {
		if fl, ok := flagOfEnv(name); ok {
			if _, ok := q.flags[fl]; !ok {
				t.Errorf("env %s (from %s): quotad serve has no --%s", name, q.env[name].source, fl)
			}
		}
	}
	if q.pod.EnableServiceLinks == nil || *q.pod.EnableServiceLinks {
		t.Errorf("enableServiceLinks must be false: Services named quotad* inject QUOTAD_*_PORT... variables, and quotad reads QUOTAD_* as flags")
	}
}

// checkState: a stable node id, the log on a per-pod volume, the DSN in a
// Secret, production settings.
func checkState(t *testing.T, q *quotadPod) {
	if v := q.env["QUOTAD_NODE_ID"]; v.from != "field:metadata.name" {
		t.Errorf("QUOTAD_NODE_ID comes from %q: want the pod name (fieldRef metadata.name), stable across restarts", v.from)
	}
	if v := q.env["QUOTAD_LEDGER"]; v.from != "secret" {
		t.Errorf("QUOTAD_LEDGER comes from %q: want a Secret (it holds the password)", v.from)
	}
	if q.setting("wal-sync") == "false" {
		t.Errorf("--wal-sync=false loses acknowledged charges on a crash: never in a deployment")
	}
	if q.setting("ring-preset") != "lan" {
		t.Errorf("--ring-preset %q: want lan in a cluster", q.setting("ring-preset"))
	}
	dataDir := q.setting("data-dir")
	var dataVolume string
	for _, vm := range q.c.VolumeMounts {
		if dataDir == vm.MountPath || strings.HasPrefix(dataDir, strings.TrimSuffix(vm.MountPath, "/")+"/") {
			dataVolume = vm.Name
		}
	}
	if !slices.ContainsFunc(q.sts.Spec.VolumeClaimTemplates, func(p corev1.PersistentVolumeClaim) bool { return p.Name == dataVolume }) {
		t.Errorf("--data-dir %q is not on a volume from volumeClaimTemplates (mounted volume %q): a restarted pod would lose its log", dataDir, dataVolume)
	}
	if q.sts.Spec.UpdateStrategy.Type != appsv1.RollingUpdateStatefulSetStrategyType {
		t.Errorf("updateStrategy %q: want RollingUpdate", q.sts.Spec.UpdateStrategy.Type)
	}
}

// checkPortsAndProbes: each address's port is a named container port, the
// addresses peers dial are the pod IP, and the probes ask the admin port for
// the paths quotad serves.
func checkPortsAndProbes(t *testing.T, q *quotadPod) {
	for _, a := range []struct{ flag, portName string }{{"http-addr", "http"}, {"rpc-addr", "rpc"}, {"admin-addr", "admin"}, {"gossip-addr", "gossip"}} {
		host, n := q.addrPort(t, a.flag)
		if p, ok := q.ports[a.portName]; !ok || p.ContainerPort != n {
			t.Errorf("--%s %q: want a container port named %q with number %d, got %+v", a.flag, q.setting(a.flag), a.portName, n, p)
		}
		if (a.flag == "rpc-addr" || a.flag == "gossip-addr") && host != downward["status.podIP"] {
			t.Errorf("--%s %q: want the pod IP ($(POD_IP) from status.podIP): peers dial the address a node advertises, and a wildcard is advertised as is", a.flag, q.setting(a.flag))
		}
	}
	_, gossip := q.addrPort(t, "gossip-addr")
	if p, ok := q.ports["gossip-udp"]; !ok || p.Protocol != corev1.ProtocolUDP || p.ContainerPort != gossip {
		t.Errorf("want a UDP container port gossip-udp on the gossip port %d (memberlist uses TCP and UDP), got %+v", gossip, p)
	}
	_, admin := q.addrPort(t, "admin-addr")
	for _, pr := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"livenessProbe", q.c.LivenessProbe, "/healthz"}, {"readinessProbe", q.c.ReadinessProbe, "/readyz"}, {"startupProbe", q.c.StartupProbe, "/healthz"}} {
		if pr.probe == nil || pr.probe.HTTPGet == nil {
			t.Errorf("%s: want an httpGet probe on %s", pr.name, pr.path)
			continue
		}
		if pr.probe.HTTPGet.Path != pr.path {
			t.Errorf("%s path %q: want %s", pr.name, pr.probe.HTTPGet.Path, pr.path)
		}
		if got := q.port(pr.probe.HTTPGet.Port); got != admin {
			t.Errorf("%s port %s (= %d): want the admin port %d (--admin-addr %q)", pr.name, pr.probe.HTTPGet.Port.String(), got, admin, q.setting("admin-addr"))
		}
	}
	if a := q.sts.Spec.Template.Annotations["prometheus.io/port"]; a != "" && a != strconv.Itoa(int(admin)) {
		t.Errorf("prometheus.io/port %q: want the admin port %d", a, admin)
	}
}

// checkShutdownBudget: the grace period covers preStop, the drain, the final
// settle and quotad's own margin.
func checkShutdownBudget(t *testing.T, q *quotadPod) {
	preStop := preStopSeconds(t, q.c)
	if preStop <= 0 {
		t.Errorf("want a preStop sleep, so endpoints stop sending traffic before SIGTERM drains")
	}
	drain, err1 := time.ParseDuration(q.setting("drain-timeout"))
	settle, err2 := time.ParseDuration(q.setting("settle-timeout"))
	if err := errors.Join(err1, err2); err != nil {
		t.Fatalf("shutdown budgets: %v", err)
	}
	var grace time.Duration
	if q.pod.TerminationGracePeriodSeconds != nil {
		grace = time.Duration(*q.pod.TerminationGracePeriodSeconds) * time.Second
	}
	if need := preStop + drain + settle + serveShutdownMargin; grace < need {
		t.Errorf("terminationGracePeriodSeconds %v < preStop %v + drain %v + settle %v + quotad's own margin %v = %v: the kubelet would kill the final settle",
			grace, preStop, drain, settle, serveShutdownMargin, need)
	}
	// With an upstream, a request may run for --upstream-timeout: a shorter
	// drain cuts such requests off at every rollout.
	if q.setting("upstream") != "" {
		if up, err := time.ParseDuration(q.setting("upstream-timeout")); err == nil && drain < up {
			t.Errorf("QUOTAD_DRAIN_TIMEOUT %v < QUOTAD_UPSTREAM_TIMEOUT %v: every rollout cuts off the requests that run longer than the drain", drain, up)
		}
	}
}

// checkServices: Services select the pods and target named ports that
// exist; the governing Service is headless and publishes unready pods, and
// --join names it; the PodDisruptionBudget lets one pod go at a time.
func checkServices(t *testing.T, q *quotadPod) {
	podLabels := q.sts.Spec.Template.Labels
	byName := map[string]*corev1.Service{}
	for _, s := range q.m.services {
		byName[s.Name] = s
		if !selects(s.Spec.Selector, podLabels) {
			t.Errorf("Service %s selector %v does not select the pods (%v)", s.Name, s.Spec.Selector, podLabels)
		}
		for _, p := range s.Spec.Ports {
			if p.TargetPort.Type != intstr.String {
				continue
			}
			cp, ok := q.ports[p.TargetPort.StrVal]
			if !ok {
				t.Errorf("Service %s port %s: no container port named %q", s.Name, p.Name, p.TargetPort.StrVal)
			} else if cp.Protocol != p.Protocol && !(cp.Protocol == "" && p.Protocol == corev1.ProtocolTCP) {
				t.Errorf("Service %s port %s is %s, container port %s is %s", s.Name, p.Name, p.Protocol, p.TargetPort.StrVal, cp.Protocol)
			}
		}
	}
	if _, ok := byName["quotad"]; !ok {
		t.Errorf("no client Service named quotad")
	}
	gossipSvc := byName[q.sts.Spec.ServiceName]
	if gossipSvc == nil {
		t.Fatalf("the StatefulSet's serviceName %q is not among the Services", q.sts.Spec.ServiceName)
	}
	if gossipSvc.Spec.ClusterIP != corev1.ClusterIPNone || !gossipSvc.Spec.PublishNotReadyAddresses {
		t.Errorf("Service %s: want headless (clusterIP None) with publishNotReadyAddresses, so starting pods find each other", gossipSvc.Name)
	}
	_, gossip := q.addrPort(t, "gossip-addr")
	join := q.setting("join")
	if strings.Contains(join, ",") {
		t.Errorf("--join %q: want the headless Service's name alone", join)
	}
	jhost, jport, err := net.SplitHostPort(join)
	if err != nil {
		jhost, jport = join, strconv.Itoa(int(gossip)) // no port: the node's gossip port
	}
	if first, _, _ := strings.Cut(jhost, "."); first != gossipSvc.Name {
		t.Errorf("--join %q: want the headless Service %q (did a namePrefix rename it?)", join, gossipSvc.Name)
	}
	if jport != strconv.Itoa(int(gossip)) {
		t.Errorf("--join %q: want the gossip port %d", join, gossip)
	}
	if len(q.m.pdbs) != 1 {
		t.Fatalf("want one PodDisruptionBudget, got %d", len(q.m.pdbs))
	}
	p := q.m.pdbs[0]
	if p.Spec.MaxUnavailable == nil || p.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget %s: want maxUnavailable 1", p.Name)
	}
	if p.Spec.Selector == nil || !selects(p.Spec.Selector.MatchLabels, podLabels) {
		t.Errorf("PodDisruptionBudget %s does not select the pods", p.Name)
	}
}

// checkSecurity: non-root, read-only, no capabilities, seccomp, no API
// token; requests and limits; spread across nodes.
func checkSecurity(t *testing.T, q *quotadPod) {
	psc, csc := q.pod.SecurityContext, q.c.SecurityContext
	if psc == nil || csc == nil {
		t.Fatalf("want pod and container securityContexts")
	}
	if !isTrue(psc.RunAsNonRoot) && !isTrue(csc.RunAsNonRoot) {
		t.Errorf("want runAsNonRoot")
	}
	if (psc.RunAsUser != nil && *psc.RunAsUser == 0) || (csc.RunAsUser != nil && *csc.RunAsUser == 0) {
		t.Errorf("runAsUser 0")
	}
	if !isTrue(csc.ReadOnlyRootFilesystem) {
		t.Errorf("want readOnlyRootFilesystem")
	}
	if csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation {
		t.Errorf("want allowPrivilegeEscalation false")
	}
	if csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, "ALL") || len(csc.Capabilities.Add) > 0 {
		t.Errorf("want capabilities: drop ALL, add none")
	}
	if psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("want seccompProfile RuntimeDefault")
	}
	if q.pod.AutomountServiceAccountToken == nil || *q.pod.AutomountServiceAccountToken {
		t.Errorf("pod: want automountServiceAccountToken false")
	}
	if !slices.ContainsFunc(q.m.accounts, func(a *corev1.ServiceAccount) bool {
		return a.Name == q.pod.ServiceAccountName && a.AutomountServiceAccountToken != nil && !*a.AutomountServiceAccountToken
	}) {
		t.Errorf("want a ServiceAccount %q with automountServiceAccountToken false", q.pod.ServiceAccountName)
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := q.c.Resources.Requests[r]; !ok {
			t.Errorf("want a %s request", r)
		}
		if _, ok := q.c.Resources.Limits[r]; !ok {
			t.Errorf("want a %s limit", r)
		}
	}
	podLabels := q.sts.Spec.Template.Labels
	spread := slices.ContainsFunc(q.pod.TopologySpreadConstraints, func(c corev1.TopologySpreadConstraint) bool {
		return c.TopologyKey == "kubernetes.io/hostname" && c.LabelSelector != nil && selects(c.LabelSelector.MatchLabels, podLabels)
	})
	anti := q.pod.Affinity != nil && q.pod.Affinity.PodAntiAffinity != nil
	if !spread && !anti {
		t.Errorf("want the pods spread across nodes (topologySpreadConstraints on kubernetes.io/hostname, or podAntiAffinity)")
	}
	// A spread that counts hosts the pod cannot run on (cordoned for a
	// drain, tainted) as empty ones leaves a drained pod Pending.
	for _, c := range q.pod.TopologySpreadConstraints {
		if c.WhenUnsatisfiable == corev1.DoNotSchedule && (c.NodeTaintsPolicy == nil || *c.NodeTaintsPolicy != corev1.NodeInclusionPolicyHonor) {
			t.Errorf("topologySpreadConstraint on %s with DoNotSchedule: want nodeTaintsPolicy: Honor", c.TopologyKey)
		}
	}
}

func isTrue(b *bool) bool { return b != nil && *b }

func selects(selector, labels map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return len(selector) > 0
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// resolveEnv resolves the container's environment as the kubelet would:
// envFrom sources in order, then env (which wins), with $(VAR) references
// to variables defined before.
func resolveEnv(t *testing.T, m *manifests, c *corev1.Container) map[string]envValue {
	t.Helper()
	env := map[string]envValue{}
	for _, ef := range c.EnvFrom {
		switch {
		case ef.ConfigMapRef != nil:
			cm := find(m.configMaps, ef.ConfigMapRef.Name)
			if cm == nil {
				t.Errorf("envFrom: no ConfigMap %q in %s", ef.ConfigMapRef.Name, m.source)
				continue
			}
			for k, v := range cm.Data {
				env[ef.Prefix+k] = envValue{value: v, from: "configmap", source: "ConfigMap " + cm.Name}
			}
		case ef.SecretRef != nil:
			s := find(m.secrets, ef.SecretRef.Name)
			if s == nil && ef.SecretRef.Optional != nil && *ef.SecretRef.Optional {
				continue // made by the operator, or not at all
			}
			if s == nil {
				t.Errorf("envFrom: no Secret %q in %s", ef.SecretRef.Name, m.source)
				continue
			}
			for k, v := range s.Data {
				env[ef.Prefix+k] = envValue{value: string(v), from: "secret", source: "Secret " + s.Name}
			}
			for k, v := range s.StringData {
				env[ef.Prefix+k] = envValue{value: v, from: "secret", source: "Secret " + s.Name}
			}
		}
	}
	defined := map[string]string{}
	for _, e := range c.Env {
		v := envValue{source: "env of the container"}
		switch {
		case e.ValueFrom == nil:
			v.from = "value"
			v.value = envRef.ReplaceAllStringFunc(e.Value, func(ref string) string {
				name := envRef.FindStringSubmatch(ref)[1]
				val, ok := defined[name]
				if !ok {
					t.Errorf("env %s: $(%s) is not defined before it (the kubelet would leave it as is)", e.Name, name)
				}
				return val
			})
		case e.ValueFrom.FieldRef != nil:
			v.from = "field:" + e.ValueFrom.FieldRef.FieldPath
			val, ok := downward[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				t.Errorf("env %s: fieldRef %s: add it to this test's downward map", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			v.value = val
		case e.ValueFrom.SecretKeyRef != nil:
			v.from = "secret"
			if s := find(m.secrets, e.ValueFrom.SecretKeyRef.Name); s != nil {
				v.value = string(s.Data[e.ValueFrom.SecretKeyRef.Key]) + s.StringData[e.ValueFrom.SecretKeyRef.Key]
			} else {
				t.Errorf("env %s: no Secret %q", e.Name, e.ValueFrom.SecretKeyRef.Name)
			}
		case e.ValueFrom.ConfigMapKeyRef != nil:
			v.from = "configmap"
			if cm := find(m.configMaps, e.ValueFrom.ConfigMapKeyRef.Name); cm != nil {
				v.value = cm.Data[e.ValueFrom.ConfigMapKeyRef.Key]
			} else {
				t.Errorf("env %s: no ConfigMap %q", e.Name, e.ValueFrom.ConfigMapKeyRef.Name)
			}
		default:
			v.from = "other"
		}
		defined[e.Name] = v.value
		if prev, ok := env[e.Name]; ok && prev.from != v.from && prev.value != v.value {
			// env wins over envFrom: the ConfigMap's or Secret's value is
			// silently ignored (an overlay's configMapGenerator setting
			// QUOTAD_DRAIN_TIMEOUT, say).
			t.Errorf("%s = %q from %s is overridden by the container's env entry (%q): the kubelet ignores it; change the env entry with a patch instead",
				e.Name, prev.value, prev.source, v.value)
		}
		env[e.Name] = v
	}
	return env
}

func find[T metav1.Object](objs []T, name string) T {
	for _, o := range objs {
		if o.GetName() == name {
			return o
		}
	}
	var zero T
	return zero
}

// preStopSeconds is the preStop hook's sleep: the kubelet's sleep action, or
// an exec of sleep N.
func preStopSeconds(t *testing.T, c *corev1.Container) time.Duration {
	t.Helper()
	if c.Lifecycle == nil || c.Lifecycle.PreStop == nil {
		return 0
	}
	h := c.Lifecycle.PreStop
	switch {
	case h.Sleep != nil:
		return time.Duration(h.Sleep.Seconds) * time.Second
	case h.Exec != nil:
		cmd := h.Exec.Command
		if len(cmd) >= 2 && strings.HasSuffix(cmd[len(cmd)-2], "sleep") {
			n, err := strconv.ParseFloat(cmd[len(cmd)-1], 64)
			if err == nil {
				return time.Duration(n * float64(time.Second))
			}
		}
	}
	t.Errorf("preStop %+v: want a sleep (lifecycle.preStop.sleep.seconds)", h)
	return 0
}

// TestServeTakesManifestSettings runs quotad serve with the manifests'
// settings (the ConfigMap's values as they are; addresses on loopback, a
// SQLite ledger and a temp data dir instead of the pod's, and an admin token
// as the optional Secret quotad-cluster-keys gives it), and checks that it
// accepts them,
// logs JSON, answers the probes' paths on the admin port, serves quotad admin
// run with the same environment plus QUOTAD_ADMIN_URL (deploy/README.md,
// "Running quotad admin against the cluster"), and exits 0 on SIGTERM within
// its budget.
func TestServeTakesManifestSettings(t *testing.T) {
	bin := buildQuotad(t)
	flags := serveFlags(t, bin)
	// The example overlay (the base's settings and a few more), or the base
	// alone without kustomize.
	var m *manifests
	if tool := kustomizeTool(); tool != nil {
		m = render(t, tool, filepath.Join("kubernetes", "overlays", "example"))
	} else {
		m = loadBase(t, filepath.Join("kubernetes", "base"))
	}
	if len(m.statefulSets) != 1 {
		t.Fatalf("want one StatefulSet")
	}
	c := &m.statefulSets[0].Spec.Template.Spec.Containers[0]
	env := resolveEnv(t, m, c)
	// deploy/README.md turns the admin API on (and locks the internal ports)
	// through this Secret: the container must read it whole, and start
	// without it.
	keysFrom := false
	for _, ef := range c.EnvFrom {
		keysFrom = keysFrom || ef.SecretRef != nil && ef.SecretRef.Name == "quotad-cluster-keys" && ef.SecretRef.Optional != nil && *ef.SecretRef.Optional
	}
	if !keysFrom {
		t.Errorf("the container has no envFrom of the optional Secret quotad-cluster-keys, which deploy/README.md puts QUOTAD_ADMIN_TOKEN and the cluster keys in")
	}

	dir := t.TempDir()
	free := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return l.Addr().String()
	}
	admin := free()
	const adminToken = "deploy-test-admin-token-0123456789"
	override := map[string]string{
		"QUOTAD_DATA_DIR":    filepath.Join(dir, "data"),
		"QUOTAD_LEDGER":      "sqlite:" + filepath.Join(dir, "ledger.db"),
		"QUOTAD_HTTP_ADDR":   free(),
		"QUOTAD_RPC_ADDR":    free(),
		"QUOTAD_ADMIN_ADDR":  admin,
		"QUOTAD_GOSSIP_ADDR": free(),
		"QUOTAD_ADMIN_TOKEN": adminToken, // from the Secret quotad-cluster-keys
	}
	drop := map[string]bool{"QUOTAD_JOIN": true} // the first and only node
	procEnv := cleanEnv()
	for name, v := range env {
		if !strings.HasPrefix(name, "QUOTAD_") || drop[name] {
			continue
		}
		if o, ok := override[name]; ok {
			v.value = o
		}
		procEnv = append(procEnv, name+"="+v.value)
	}
	for name, v := range override {
		if _, ok := env[name]; !ok {
			procEnv = append(procEnv, name+"="+v)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, c.Args...)
	cmd.Env = procEnv
	var logs logbuf.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("quotad output:\n%s", logs.String())
		}
	}()

	probePath := func(p *corev1.Probe) string { return p.HTTPGet.Path }
	get := func(path string) (int, error) {
		client := &http.Client{Timeout: 2 * time.Second}
		resp, err := client.Get("http://" + admin + path)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, path := range []string{probePath(c.LivenessProbe), probePath(c.ReadinessProbe)} {
		for {
			code, err := get(path)
			if code == http.StatusOK {
				break
			}
			select {
			case err := <-exited:
				t.Fatalf("quotad serve exited before GET %s answered 200: %v", path, err)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("GET %s on the admin port: %d %v after 60s", path, code, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// quotad admin in the pod's environment (QUOTAD_ADMIN_ADDR is the node's
	// host:port, QUOTAD_ADMIN_TOKEN the Secret's) with the URL a port-forward
	// gives: the two commands' variables do not clash, and nothing is
	// warned about.
	adminCmd := exec.CommandContext(ctx, bin, "admin", "nodes")
	adminCmd.Env = append(slices.Clone(procEnv), "QUOTAD_ADMIN_URL=http://"+admin)
	var adminOut, adminErr bytes.Buffer
	adminCmd.Stdout, adminCmd.Stderr = &adminOut, &adminErr
	if err := adminCmd.Run(); err != nil || !strings.Contains(adminOut.String(), env["QUOTAD_NODE_ID"].value) || adminErr.Len() > 0 {
		t.Errorf("quotad admin nodes with the pod's environment and QUOTAD_ADMIN_URL: %v\nstdout:\n%s\nstderr:\n%s\nwant this node listed and nothing on stderr",
			err, adminOut.String(), adminErr.String())
	}

	drain, _ := time.ParseDuration(env["QUOTAD_DRAIN_TIMEOUT"].value)
	settle, _ := time.ParseDuration(env["QUOTAD_SETTLE_TIMEOUT"].value)
	if drain == 0 || settle == 0 {
		drain, _ = time.ParseDuration(flags["drain-timeout"].def)
		settle, _ = time.ParseDuration(flags["settle-timeout"].def)
	}
	budget := drain + settle + serveShutdownMargin
	t0 := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("quotad serve exited with %v after SIGTERM: want 0 (it settled everything)", err)
		}
		t.Logf("exited %v after SIGTERM (budget %v)", time.Since(t0).Round(time.Millisecond), budget)
	case <-time.After(budget):
		t.Errorf("quotad serve still running %v after SIGTERM", budget)
	}

	// --log-format json: every log line is a JSON object.
	if env["QUOTAD_LOG_FORMAT"].value == "json" {
		for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			if l != "" && !json.Valid([]byte(l)) {
				t.Errorf("the manifests ask for JSON logs; this line is not JSON: %s", l)
				break
			}
		}
	}
}

// checkLedgerMaintenance: the overlay's CronJob (the monthly quotad migrate
// and quotad prune) runs the image the StatefulSet runs, as the same
// non-root user, with only commands and flags quotad has, reading the DSN
// from the Secret the nodes read; and its commands, run as written in
// order against a real (SQLite) ledger, succeed.
func checkLedgerMaintenance(t *testing.T, m *manifests, bin string) {
	if len(m.cronJobs) != 1 {
		t.Fatalf("want one CronJob (quotad-ledger-maintenance), got %d", len(m.cronJobs))
	}
	cj := m.cronJobs[0]
	if cj.Spec.ConcurrencyPolicy != batchv1.ForbidConcurrent {
		t.Errorf("CronJob %s: concurrencyPolicy %q, want Forbid (two prunes at once only wait on each other)", cj.Name, cj.Spec.ConcurrencyPolicy)
	}
	if cj.Spec.TimeZone == nil || *cj.Spec.TimeZone != "Etc/UTC" {
		t.Errorf("CronJob %s: timeZone %v, want Etc/UTC (months are UTC months)", cj.Name, cj.Spec.TimeZone)
	}
	node := newQuotadPod(t, m, nil).c
	nodeImage, ledgerSecret := node.Image, ""
	for _, e := range node.EnvFrom {
		if e.SecretRef != nil && strings.HasPrefix(e.SecretRef.Name, "quotad-ledger") { // with kustomize's hash suffix
			ledgerSecret = e.SecretRef.Name
		}
	}
	pod := cj.Spec.JobTemplate.Spec.Template.Spec
	if pod.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("CronJob %s: restartPolicy %q, want Never (a failed prune says why once; backoffLimit retries)", cj.Name, pod.RestartPolicy)
	}
	if pod.EnableServiceLinks == nil || *pod.EnableServiceLinks {
		t.Errorf("CronJob %s: enableServiceLinks must be false (quotad reads QUOTAD_* as flags)", cj.Name)
	}
	if sc := pod.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("CronJob %s: the pod must run as non-root", cj.Name)
	}
	ledger := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	containers := slices.Concat(pod.InitContainers, pod.Containers)
	var commands []string
	for _, c := range containers {
		if c.Image != nodeImage {
			t.Errorf("CronJob %s, container %s: image %q, want the nodes' %q (a prune must know the rules the nodes run by)", cj.Name, c.Name, c.Image, nodeImage)
		}
		if len(c.Args) == 0 {
			t.Errorf("CronJob %s, container %s: no args: want a quotad command", cj.Name, c.Name)
			continue
		}
		commands = append(commands, c.Args[0])
		flags, _ := commandFlags(t, bin, c.Args[0])
		for _, a := range c.Args[1:] {
			name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if _, ok := flags[name]; !strings.HasPrefix(a, "--") || !ok {
				t.Errorf("CronJob %s, container %s: argument %q is not a flag of quotad %s (pass flags as --name=value)", cj.Name, c.Name, a, c.Args[0])
			}
		}
		if !slices.ContainsFunc(c.EnvFrom, func(e corev1.EnvFromSource) bool { return e.SecretRef != nil && e.SecretRef.Name == ledgerSecret }) {
			t.Errorf("CronJob %s, container %s: want QUOTAD_LEDGER from the Secret the nodes read it from, %q", cj.Name, c.Name, ledgerSecret)
		}
		if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
			sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("CronJob %s, container %s: want a read-only root filesystem and no privilege escalation", cj.Name, c.Name)
		}
		cmd := exec.Command(bin, c.Args...)
		cmd.Env = append(cleanEnv(), "QUOTAD_LEDGER="+ledger)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("CronJob %s, container %s: quotad %s on a new ledger: %v\n%s", cj.Name, c.Name, strings.Join(c.Args, " "), err, out)
		}
		t.Logf("quotad %s:\n%s", strings.Join(c.Args, " "), out)
	}
	if !slices.Equal(commands, []string{"migrate", "prune"}) {
		t.Errorf("CronJob %s runs %q, want migrate (init container), then prune", cj.Name, commands)
	}
}
