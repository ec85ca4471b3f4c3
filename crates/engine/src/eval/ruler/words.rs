//! Word lists of `eval --task ruler`: adjectives and nouns for the NIAH keys
//! ("adjective-noun", as RULER draws them) and the pool of common-words extraction.

/// Adjectives of the NIAH keys.
pub const ADJECTIVES: &str = "able abundant acid adorable aggressive agreeable alert ancient \
angry anxious apricot aquatic arrogant ashamed average awesome bashful beautiful bewildered \
bitter black bloody blue blushing boring brainy brave breezy brief bright broad broken bumpy \
busy calm careful cautious charming cheerful chilly chubby clean clever cloudy clumsy cold \
colorful comfortable concerned confused cooing crooked crowded cruel curious curly cute \
damaged dangerous dark deep defiant delicious delightful dependent determined different \
difficult dirty disgusted distinct dizzy drab dull eager early elegant embarrassed empty \
enchanting encouraging energetic enthusiastic envious evil excited expensive exuberant fair \
faithful famous fancy fantastic fierce filthy fine flaky fluffy foolish fragile frail \
frantic friendly frightened funny fuzzy gentle gifted gigantic glamorous gleaming glorious \
golden gorgeous graceful greasy green grumpy handsome happy harsh healthy heavy helpful \
helpless hilarious hollow homeless hot huge humble hungry icy illegal immense important \
impossible inexpensive innocent inquisitive itchy jealous jittery jolly joyous juicy kind \
large lazy light lively lonely long loose loud lovely lucky magnificent massive melodic messy \
mighty misty modern motionless muddy mushy mysterious narrow nasty naughty nervous nice noisy \
nutty obedient obnoxious odd old orange ordinary outrageous outstanding panicky perfect plain \
pleasant poised polite poor powerful precious prickly proud purple puzzled quaint quick quiet \
rainy rapid rare red relieved remarkable rich rotten round rough royal rustic salty scary \
scrawny selfish shaggy shallow sharp shiny short shy silent silly skinny sleepy slimy slow \
small smiling smooth soft sore sparkling spicy splendid spotless spotty square steady sticky \
stormy strange strong stupid successful super sweet swift tall tame tasty tender tense \
terrible thankful thick thirsty thoughtful tiny tired tough troubled ugly uneven unusual \
upset uptight vast victorious violet vivacious wandering warm wasteful weak weary wet white \
wicked wide wild windy wise witty wonderful wooden worried wrong yellow young zany zealous";

/// Nouns of the NIAH keys.
pub const NOUNS: &str = "account acoustics action activity actor addition adjustment \
advertisement advice afternoon airport alarm amount amusement animal answer apparatus apple \
argument army arrow attack attempt attention attraction aunt authority baby back badge bag \
balance ball balloon banana band base baseball basin basket battle bead bean bear bed bedroom \
bee beef beggar believe bell berry bird birthday blade blanket blood board boat body bomb \
bone book boot border bottle boundary box brain branch brass bread breakfast breath brick \
bridge brother brush bubble bucket building bulb burst butter button cabbage cake calendar \
camera camp canvas cap caption car card carpenter carriage cart cast cat cattle cause cave \
celery cellar cemetery chain chair chalk chance change channel cheese cherry chess chicken \
children chin church circle cloth cloud clover club coach coal coast coat cobweb coil collar \
comb committee company comparison competition condition connection copper corn cough country \
cover cow crack cracker crate crayon cream creator creature credit crib crime crook crow \
crowd crown cub cup current curtain cushion daughter day decision deer degree desk \
destruction development digestion dinner dinosaur direction dirt discovery division dock \
doctor dog doll donkey door drain drawer dress drink driving drop duck dust eggnog elbow \
engine error event example expansion experience expert eye face fact fairy family fan fang \
farm father faucet feather feeling field finger fireman fish flag flame flavor flight flock \
floor flower fog fold food foot force fork form fowl frame friction friend frog fruit \
furniture garden gate geese ghost giraffe glass glove goat gold goose government governor \
grain grape grass grip ground group guide guitar gun hair haircut hall hammer hand harbor \
harmony hat hate head health heart hill history hobbies hole holiday home honey hook hope \
horn horse hose hospital hour house humor hydrant ice icicle idea impulse income industry \
ink insect instrument insurance interest invention iron island jail jam jar jeans jelly \
jewel journey judge juice kettle key kitten kitty knee knife knot lace ladybug lake lamp \
land language laugh lawyer lead leaf leather leg letter lettuce level library light limit \
line linen lip liquid lizard loaf lock locket look loss love low lunch lunchroom machine \
magic maid mailbox man map marble mark market mask mass match meal measure meat meeting \
memory metal mice middle milk mind mine minister mint mist mitten money monkey month moon \
morning mother motion mountain mouth move muscle music nail name nation neck need needle \
nerve nest net news night noise north nose note notebook number nut oatmeal observation \
ocean offer office oil orange oven owl page pail pan pancake paper parcel park partner party \
passenger paste patch payment peace pear pen pencil person pest pet piano pickle picture pie \
pig pin pipe pizza place plane plant plantation plastic plate playground plot plough pocket \
point poison police popcorn porter position potato powder power price prison produce profit \
property prose protest pull pump punishment purpose quarter queen question quicksand quiet \
quill quilt quince quiver rabbit rail rain rainstorm rake rat rate ray reaction reading \
receipt recess record regret relation religion representative request respect rest reward \
rhythm rice riddle rifle ring river road robin rock rod roll roof room root rose route rub \
rule run sack sail salt sand scale scarecrow scarf scene scent school science scissors \
screw sea seashore seat secretary seed selection self sense servant shade shake shame shape \
sheep sheet shelf ship shirt shock shoe side sign silk silver sink sister size skate skin \
skirt sky slave sleep sleet slip slope smash smell smile smoke snail snake sneeze snow soap \
society sock soda sofa son song sound soup space spade spark spider sponge spoon spot spring \
spy square squirrel stage stamp star start station steam steel stem step stew stick stitch \
stocking stomach stone stop store story stove stranger straw stream street stretch string \
structure substance sugar suggestion suit summer sun support surprise sweater swim swing \
system table tail talk tank taste tax teaching team teeth temper tent territory test texture \
thing thought thread thrill throat thumb thunder ticket tiger time tin title toad toe \
tomatoes tongue tooth toothbrush toothpaste top touch town toy trade trail train tramp tray \
treatment tree trick trip trouble trousers truck tub turkey turn twig twist umbrella uncle \
underwear unit use vacation valley value van vase vegetable veil vein verse vessel vest view \
visitor voice volcano volleyball voyage walk wall war wash waste watch water wave wax way \
wealth weather week weight wheel whip whistle wilderness wind window wine wing winter wire \
wish woman wood wool word work worm wound wren wrench wrist writer writing yak yam yard yarn \
year yoke zebra zephyr zinc zipper zoo";

/// Verbs, added to the adjectives and nouns in the common-words pool.
pub const VERBS: &str = "accept add admire admit advise afford agree alert allow amuse \
announce annoy answer apologise appear applaud appreciate approve argue arrange arrest arrive \
ask attach attack attempt attend attract avoid back bake balance ban bang bathe battle beam \
beg behave belong bleach bless blind blink blot blush boast boil bolt bomb book bore borrow \
bounce bow box brake branch breathe bruise brush bubble bump burn bury buzz calculate call \
camp care carry carve cause challenge change charge chase cheat check cheer chew choke chop \
claim clap clean clear clip close coach coil collect colour comb command communicate compare \
compete complain complete concentrate concern confess confuse connect consider consist \
contain continue copy correct cough count cover crack crash crawl cross crush cry cure curl \
curve cycle dam damage dance dare decay deceive decide decorate delay delight deliver depend \
describe desert deserve destroy detect develop disagree disappear disapprove disarm discover \
dislike divide double doubt drag drain dream dress drip drop drown dry dust earn educate \
embarrass employ empty encourage end enjoy enter entertain escape examine excite excuse \
exercise exist expand expect explain explode extend face fade fail fancy fasten fax fear \
fence fetch file fill film fire fit fix flap flash float flood flow flower fold follow fool \
force form found frame frighten fry gather gaze glow glue grab grate grease greet grin grip \
groan guarantee guard guess guide hammer hand handle hang happen harm hate haunt head heal \
heap heat help hook hop hope hover hug hum hunt hurry identify ignore imagine impress \
improve include increase influence inform inject injure instruct intend interest interfere \
interrupt introduce invent invite irritate itch jail jam jog join joke judge juggle jump \
kick kill kiss kneel knit knock knot label land last laugh launch learn level license lick \
lie lighten like list listen live load lock long look love manage march mark marry match \
mate matter measure melt memorise mend milk mine miss mix moan moor mourn move muddle mug \
multiply murder nail name need nest nod note notice number obey object observe obtain occur \
offend offer open order overflow owe own pack paddle paint park part pass paste pat pause \
peck pedal peel peep perform permit phone pick pinch pine place plan plant play please \
plug point poke polish pop possess post pour practise pray preach precede prefer prepare \
present preserve press pretend prevent prick print produce program promise protect provide \
pull pump punch puncture punish push question queue race radiate rain raise reach realise \
receive recognise record reduce reflect refuse regret reign reject rejoice relax release \
rely remain remember remind remove repair repeat replace reply report reproduce request \
rescue retire return rhyme rinse risk rob rock roll rot rub ruin rule rush sack sail \
satisfy save saw scare scatter scold scorch scrape scratch scream screw scribble scrub seal \
search separate serve settle shade share shave shelter shiver shock shop shrug sigh sign \
signal sin sip ski skip slap slip slow smash smell smile smoke snatch sneeze sniff snore \
snow soak soothe sound spare spark sparkle spell spill spoil spot spray sprout squash \
squeak squeal squeeze stain stamp stare start stay steer step stir stitch stop store strap \
strengthen stretch strip stroke stuff subtract succeed suck suffer suggest suit supply \
support suppose surprise surround suspect suspend switch talk tame tap taste tease \
telephone tempt terrify test thank thaw tick tickle tie time tip tire touch tour tow trace \
trade train transport trap travel treat tremble trick trip trot trouble trust try tug \
tumble turn twist type undress unfasten unite unlock unpack untidy use vanish visit wail \
wait walk wander want warm warn wash waste watch water wave weigh welcome whine whip \
whirl whisper whistle wink wipe wish wobble wonder work worry wrap wreck wrestle wriggle \
yawn yell zip zoom";

/// `s` split into its words.
pub fn list(s: &'static str) -> Vec<&'static str> {
    s.split_whitespace().collect()
}

/// The common-words pool: every distinct word of the three lists, in a fixed order.
pub fn pool() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = [ADJECTIVES, NOUNS, VERBS]
        .iter()
        .flat_map(|s| s.split_whitespace())
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}
